"""Background servers give way: real process groups (plain shells standing in for vLLM servers,
``/health`` answered by a flag) are held with SIGSTOP while a foreground server starts, parked as
soon as they are healthy, and resumed by promote() and stop()."""

import subprocess
import threading
import time

import pytest

from leasekit.cluster import background, procs
from leasekit.cluster.server import VllmServer
from leasekit.cluster.serverspec import ServerSpec

SCRIPT = "sleep 60 & sleep 61 & wait"


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _stopped(server) -> bool:
    return all(_state(pid) == "T" for pid in server.pids())


def _running(server) -> bool:
    return all(_state(pid) in ("S", "R") for pid in server.pids())


def _server(tmp_path, name: str, *, idle: bool, healthy: bool = False) -> VllmServer:
    """A VllmServer whose process group is a shell with two sleeps; ``server.health[0]`` is what
    ``/health`` answers."""
    server = VllmServer(ServerSpec(name=name, role="decode", connector="stock", model_dir=tmp_path), tmp_path)
    server.health = [healthy]
    server.healthy = lambda timeout_s=2.0: server.health[0]
    server.proc = subprocess.Popen(["bash", "-c", SCRIPT], start_new_session=True)
    server.started_at = time.monotonic()
    assert procs.wait_until(lambda: len(server.pids()) == 3, 10)
    if idle:
        server.idle = server._started_idle = True
        background.register(server)
    return server


@pytest.fixture
def servers(tmp_path):
    made = []

    def make(name, **kwargs):
        made.append(_server(tmp_path / name, name, **kwargs))
        return made[-1]

    yield make
    for server in made:
        server.stop(grace_s=1)


def test_warming_spares_are_held_while_a_foreground_server_starts_then_resumed(servers):
    warming, parked = servers("warming", idle=True), servers("parked", idle=True, healthy=True)
    assert procs.wait_until(lambda: parked.parked and _stopped(parked), 5)  # the parking thread
    foreground = servers("foreground", idle=False)
    seen = {}

    def become_healthy():
        time.sleep(1.0)
        seen["warming stopped"] = _stopped(warming) and warming.paused
        foreground.health[0] = True

    threading.Thread(target=become_healthy).start()
    assert foreground.wait_healthy(30) >= 1.0
    assert seen["warming stopped"]
    assert procs.wait_until(lambda: _running(warming), 5) and not warming.paused
    assert parked.parked and _stopped(parked)  # a parked spare stays parked until promoted


def test_a_spare_promoted_during_a_foreground_start_runs_at_once_and_stays_running(servers):
    spare = servers("spare", idle=True)
    with background.paused_for_foreground() as held:
        assert held == [spare] and procs.wait_until(lambda: _stopped(spare), 5)
        spare.promote()
        assert procs.wait_until(lambda: _running(spare), 5) and not spare.idle
    assert _running(spare) and not spare.paused
    spare.health[0] = True
    time.sleep(2 * background.PARK_POLL_S + 0.5)
    assert not spare.parked and _running(spare)  # promoted: never parked again


def test_a_spare_is_parked_once_healthy_and_promote_resumes_it(servers):
    spare = servers("spare", idle=True)
    time.sleep(2 * background.PARK_POLL_S + 0.5)
    assert not spare.parked and _running(spare)  # not healthy yet: keeps warming up
    spare.health[0] = True
    assert procs.wait_until(lambda: spare.parked and _stopped(spare), 5)
    spare.promote()
    assert procs.wait_until(lambda: _running(spare), 5) and not spare.parked


def test_stop_ends_a_paused_spare_at_once(servers):
    spare = servers("spare", idle=True)
    pids = spare.pids()
    with background.paused_for_foreground():
        assert procs.wait_until(lambda: _stopped(spare), 5)
        started = time.monotonic()
        spare.stop(grace_s=5)
        assert time.monotonic() - started < 4  # SIGTERM acted on at once, no wait for the SIGKILL
    assert all(_state(pid) in (None, "Z") for pid in pids)


def test_a_stall_of_a_pair_server_holds_warming_spares_for_its_duration(servers):
    """A SIGSTOP stall of D run by ``FaultRun.run`` (the chaos runner's own path) holds a spare still
    warming up while D is stopped (the reclaim deadlines fall there and P's step is judged against
    the tick) and resumes it with D; a kill or an armed writer stall holds nothing."""
    from types import SimpleNamespace

    from leasekit.chaos import actions
    from leasekit.chaos.schema import KillFault, StallFault
    from leasekit.lease.config import LeaseTiming

    spare, decode = servers("spare", idle=True), servers("decode", idle=False)
    seen = []

    def watch():
        time.sleep(0.7)
        seen.append((_stopped(decode), _stopped(spare), spare.paused))

    watcher = threading.Thread(target=watch)
    run = actions.FaultRun(SimpleNamespace(decode=decode, prefill=None),
                           [StallFault(kind="stall", method="sigstop", duration_s=1.5)], [0.0], LeaseTiming(6, 1, 4))
    watcher.start()
    run.run(time.monotonic())
    watcher.join()
    assert seen == [(True, True, True)]
    assert [e.took_effect for e in run.effects] == [True]
    assert procs.wait_until(lambda: _running(spare) and _running(decode), 5) and not spare.paused
    for fault in (KillFault(kind="kill"), StallFault(kind="stall", method="push_writer", target="prefill", duration_s=1)):
        with actions._quiet_during(fault) as held:
            assert held is None and _running(spare) and not spare.paused
