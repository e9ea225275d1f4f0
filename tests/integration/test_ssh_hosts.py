"""Separate hosts over real SSH: a testbed of two host namespaces (prefill, decode), a real OpenSSH
server in each, and the controller in the root namespace. Process groups start on a host, obey
SIGSTOP/SIGCONT/SIGKILL, files come back over SFTP, the host's clock is read remotely, preflight
refuses what is missing with its fix, and nothing is left on the host after teardown, a lost
connection, a dead sshd or a controller ended by SIGTERM (the host's watchdog). No vLLM."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from leasekit.cluster.hosts import HostTeardownError, HostUnreachable, PreflightError
from leasekit.cluster.localhost import LocalHost
from leasekit.cluster.procs import wait_until
from leasekit.cluster.sshd import SshServer
from leasekit.cluster.sshhost import SshHost
from leasekit.cluster.testbed import Testbed

pytestmark = pytest.mark.hosts

HEARTBEAT_S, STALE_S = 0.5, 2.0
TICKER = ["sh", "-c", "while :; do echo tick; sleep 0.05; done"]


@pytest.fixture(scope="module")
def bed():
    """``(testbed, {host: SshServer})``: sshd on port 22 of each host's address."""
    with Testbed(["prefill", "decode"]) as testbed:
        servers = {h: SshServer(testbed.address(h), namespace=testbed.namespace(h)) for h in testbed.hosts}
        try:
            for server in servers.values():
                server.start()
            yield testbed, servers
        finally:
            for server in servers.values():
                server.stop()


@pytest.fixture
def decode(bed):
    """An SshHost for ``decode`` with a fast heartbeat; torn down after the test (if not already)."""
    host = bed[1]["decode"].ssh_host("decode", heartbeat_s=HEARTBEAT_S, stale_s=STALE_S)
    yield host
    try:
        host.teardown()
    except HostTeardownError:
        pass


def _state(pid: int) -> str | None:
    """The process state letter of ``pid`` (same machine: the hosts share its pid namespace); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _running(pids) -> list[int]:
    """The pids still running (zombies are dead: this machine's init does not reap orphans)."""
    return [pid for pid in pids if _state(pid) not in (None, "Z", "X")]


def _stop_pending(pid: int) -> bool:
    """Whether SIGSTOP is pending for ``pid`` (its ``SigPnd`` or ``ShdPnd`` mask in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            masks = [int(line.split()[1], 16) for line in handle if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return any(mask & (1 << (signal.SIGSTOP - 1)) for mask in masks)


def _stopped(pid: int) -> bool:
    """Stopped (state T), or in uninterruptible sleep (state D: a write throttled by a busy disk, as
    on a loaded CI machine) with SIGSTOP pending, which stops it as soon as the sleep ends."""
    state = _state(pid)
    return state == "T" or (state == "D" and _stop_pending(pid))


def _all_stopped(host, pgid: int, timeout_s: float = 10.0) -> bool:
    """Wait until every process of the group is stopped (see :func:`_stopped`); AssertionError with the states if not."""
    if wait_until(lambda: all(_stopped(p) for p in host.group_pids(pgid)), timeout_s):
        return True
    raise AssertionError(f"group {pgid} not stopped: {[(p, _state(p)) for p in host.group_pids(pgid)]}")


def _exists_on(bed, host: str, path: str) -> bool:
    """Whether ``path`` exists on ``host``, asked over a fresh SSH connection."""
    with bed[1][host].ssh_host(f"{host}-probe") as probe:
        return probe.run(["test", "-e", path])[0] == 0


def test_group_runs_in_host_namespace_obeys_signals_and_survives_the_session(bed, decode):
    testbed, _ = bed
    pgid = decode.spawn(TICKER, name="ticker")
    assert wait_until(lambda: len(decode.group_pids(pgid)) >= 1, 5)
    identify = subprocess.run(["ip", "netns", "identify", str(pgid)], capture_output=True, text=True, check=True)
    assert identify.stdout.strip() == testbed.namespace("decode")
    assert decode.read_file("pids/ticker.pid").decode().strip() == str(pgid)

    log = "logs/ticker.log"
    assert decode.signal_group(pgid, signal.SIGSTOP)
    assert _all_stopped(decode, pgid)
    size = len(decode.read_file(log))
    time.sleep(0.3)
    assert len(decode.read_file(log)) == size, "a stopped group kept writing"
    assert decode.signal_group(pgid, signal.SIGCONT)
    assert wait_until(lambda: len(decode.read_file(log)) > size, 5), "the group did not resume"

    decode._close()  # the SSH session that started it ends: the group lives on
    assert decode.alive(pgid)
    assert decode.pin(pgid, [0]) >= 1
    assert os.sched_getaffinity(pgid) == {0}  # the loop's shell; its short-lived sleeps inherit it

    pids = decode.group_pids(pgid)
    assert decode.signal_group(pgid, signal.SIGKILL)
    assert wait_until(lambda: not decode.alive(pgid), 5)
    assert not _running(pids)
    assert decode.signal_group(pgid, signal.SIGKILL) is False
    with pytest.raises(ValueError, match="not spawned by this run"):
        decode.signal_group(1, signal.SIGCONT)


def test_files_come_back_and_teardown_removes_them(bed, decode, tmp_path):
    pgid = decode.spawn(["sh", "-c", "echo span-1; echo span-2 >&2"], name="spans")
    assert wait_until(lambda: not decode.alive(pgid), 5)
    local = decode.fetch("logs/spans.log", tmp_path / "back" / "spans.log")
    assert sorted(local.read_text().split()) == ["span-1", "span-2"]
    outside = f"/tmp/leasekit-test-{os.getpid()}-{time.monotonic_ns()}.json"
    assert decode.write_file(outside, '{"k": 1}') == outside
    assert decode.read_file(outside) == b'{"k": 1}'
    run_dir = decode.run_dir
    report = decode.teardown()
    assert run_dir in report.removed and outside in report.removed
    assert not _exists_on(bed, "decode", outside) and not _exists_on(bed, "decode", run_dir)


def test_perf_counter_read_on_the_host_matches_this_clock(decode):
    reading = decode.perf_counter()
    # one machine, one CLOCK_MONOTONIC: the true offset is 0, which the reading must bracket
    assert abs(reading.offset_s) <= reading.uncertainty_s + 1e-6, reading
    assert 0 < reading.uncertainty_s < 0.05
    assert abs(reading.local_s - time.perf_counter()) < 1.0


def test_preflight_refuses_what_is_missing_with_the_fix(decode):
    decode.preflight(["ip", "nft", "unshare", "taskset", "faketime"], python_modules=["json"], root=True)
    with pytest.raises(PreflightError) as refused:
        decode.preflight(["ip", "/nonexistent/nft", "leasekit-no-such-tool"], python_modules=["leasekit_no_such_module"])
    message = str(refused.value)
    assert "host decode lacks /nonexistent/nft; fix: apt-get install nftables on decode" in message
    assert "host decode lacks leasekit-no-such-tool; fix: install leasekit-no-such-tool on decode" in message
    assert "cannot import leasekit_no_such_module" in message and "lacks ip" not in message


def test_unreachable_host_and_refused_login_name_host_and_address(bed):
    testbed, servers = bed
    address = testbed.address("decode")
    wrong_port = SshHost("decode", address, port=2222, identity_file=servers["decode"].client_key,
                         known_hosts=servers["decode"].known_hosts, connect_timeout_s=3)
    with pytest.raises(HostUnreachable, match=rf"host decode \(root@{address}:2222\) unreachable.*fix: check that sshd listens"):
        wrong_port.run(["true"])
    wrong_key = SshHost("decode", address, identity_file=servers["prefill"].client_key,
                        known_hosts=servers["decode"].known_hosts, connect_timeout_s=3)
    with pytest.raises(HostUnreachable, match=rf"host decode \(root@{address}:22\): login refused.*fix: add the public key"):
        wrong_key.run(["true"])
    unknown_key = SshHost("decode", address, identity_file=servers["decode"].client_key,
                          known_hosts=servers["prefill"].known_hosts, connect_timeout_s=3)
    with pytest.raises(HostUnreachable, match=r"host decode .*fix: add its key to"):
        unknown_key.run(["true"])


def test_teardown_after_a_lost_connection_reconnects_and_leaves_nothing(bed, decode):
    pgid = decode.spawn(["sleep", "300"], name="sleeper")
    pids = decode.group_pids(pgid)
    assert _running(pids)
    decode.drop_connection()  # no SSH goodbye: the transport just dies
    report = decode.teardown()
    assert pgid in report.killed
    assert not _running(pids)
    assert not _exists_on(bed, "decode", decode.run_dir)


def test_watchdog_ends_the_groups_when_the_host_is_lost(bed, decode):
    _, servers = bed
    pgid = decode.spawn(["sleep", "300"], name="orphan")
    pids = decode.group_pids(pgid)
    started = time.monotonic()
    servers["decode"].stop(keep_state=True)  # sshd and every session gone: no more heartbeats
    try:
        assert wait_until(lambda: not _running(pids), STALE_S + 5, 0.1), "the watchdog did not end the group"
        assert time.monotonic() - started >= STALE_S - 2 * HEARTBEAT_S, "ended before the heartbeat went stale"
        with pytest.raises(HostTeardownError, match=r"host decode .*watchdog"):
            decode.teardown()
    finally:
        servers["decode"].start()
    assert not _exists_on(bed, "decode", decode.run_dir)


CONTROLLER = textwrap.dedent("""
    import sys, time
    from leasekit.cluster.sshhost import SshHost
    address, key, known_hosts = sys.argv[1:4]
    host = SshHost("decode", address, identity_file=key, known_hosts=known_hosts, heartbeat_s=0.5, stale_s=2)
    pgid = host.spawn(["sleep", "300"], name="held")
    print(pgid, host.run_dir, " ".join(map(str, host.group_pids(pgid))), flush=True)
    time.sleep(300)
""")


def test_sigterm_of_the_controller_leaves_nothing_on_the_host(bed):
    testbed, servers = bed
    server = servers["decode"]
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER, testbed.address("decode"), str(server.client_key),
                                   str(server.known_hosts)], stdout=subprocess.PIPE, text=True)
    try:
        pgid, run_dir, *pids = controller.stdout.readline().split()
        assert _running([int(p) for p in pids]) and _exists_on(bed, "decode", run_dir)
        controller.send_signal(signal.SIGTERM)  # default disposition: no finally, no teardown runs
        assert controller.wait(timeout=10) == -signal.SIGTERM
        assert wait_until(lambda: not _running([int(pgid), *map(int, pids)]), STALE_S + 5, 0.1)
        assert wait_until(lambda: not _exists_on(bed, "decode", run_dir), 5)
    finally:
        controller.kill()
        controller.wait()


def test_local_host_spawns_signals_and_tears_down(tmp_path):
    with LocalHost(heartbeat_s=HEARTBEAT_S, stale_s=STALE_S) as host:
        pgid = host.spawn(TICKER, name="ticker", cwd=str(tmp_path))
        assert wait_until(lambda: host.alive(pgid), 5)
        assert host.signal_group(pgid, signal.SIGSTOP)
        assert _all_stopped(host, pgid)
        assert host.signal_group(pgid, signal.SIGCONT)
        assert host.perf_counter().uncertainty_s == 0
        pids, run_dir = host.group_pids(pgid), host.run_dir
    assert not _running(pids) and not os.path.exists(run_dir)


def test_pair_file_runner_answers_255_with_the_fix_for_an_unreachable_host(bed):
    from leasekit.cluster.remote import runner_for
    from leasekit.cluster.pairfile import HostSpec

    testbed, servers = bed
    spec = HostSpec(address=testbed.address("decode"), ssh_port=2222, identity_file=str(servers["decode"].client_key),
                    python="python3")
    rc, out, err = runner_for("decode", spec)(["true"])
    assert (rc, out) == (255, "")
    assert f"host decode (root@{testbed.address('decode')}:2222) unreachable" in err and "fix:" in err
