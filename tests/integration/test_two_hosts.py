"""Chaos scenarios with P and D on two separate SSH hosts (Jepsen-style): a testbed of two network
namespaces on this machine, an sshd in each with keys made for the run, the pair file written for
them; P runs on one host, D on the other, NIXL/UCX traffic crosses the bridge, every fault runs on
the host of its target through the Host interface. One deployment and one suite for every case;
each case's verdict must be the catalog's. Afterwards nothing is left: no namespace, no process of
the run on either host, no run directory there.

Run: ``pytest -m hosts tests/integration/test_two_hosts.py`` (``LEASEKIT_TWO_HOSTS_SCENARIOS`` and
``LEASEKIT_TWO_HOSTS_TARGETS`` choose the cases; the whole catalog on both targets is
``leasekit chaos run --all --testbed two-hosts``)
"""

import os
import signal
import subprocess

import pytest

from leasekit.chaos.scenario import find_scenario
from leasekit.chaos.suite import Suite, plan
from leasekit.cluster.procs import wait_until
from leasekit.cluster.twohosts import TwoHostDeployment

pytestmark = [pytest.mark.hosts, pytest.mark.pair]

SCENARIOS = ["kill-decode", "stall-decode-long", "partition-long", "partition-oneway-d2p", "partition-oneway-p2d",
             "partition-short", "skew-monotonic"]
"""In priority order; ``LEASEKIT_TWO_HOSTS_SCENARIOS`` (comma-separated) runs a subset."""
TARGETS = [t.strip() for t in os.environ.get("LEASEKIT_TWO_HOSTS_TARGETS", "leasekit").split(",") if t.strip()]
"""The LeaseKit target by default (CI's time budget); ``LEASEKIT_TWO_HOSTS_TARGETS=leasekit,stock`` adds
the stock connector (every scenario's stock verdict on two hosts: about 14 minutes more)."""


def _selected() -> list[str]:
    chosen = os.environ.get("LEASEKIT_TWO_HOSTS_SCENARIOS")
    return [s.strip() for s in chosen.split(",") if s.strip()] if chosen else SCENARIOS


@pytest.fixture(scope="module")
def two_host_run(vllm_available, tmp_path_factory):
    """Run every selected case on one two-host deployment; returns ``(results by (name, target),
    deployment facts)`` after everything was torn down."""
    run_dir = tmp_path_factory.mktemp("two-hosts")
    runs = plan([find_scenario(name) for name in _selected()], TARGETS)
    with TwoHostDeployment(run_dir) as deployment:
        namespaces = [deployment.testbed.namespace(h) for h in ("prefill", "decode")]
        pair_text = deployment.pair_path.read_text()
        suite = Suite(runs, run_dir, deployment=deployment.pair)
        report = suite.execute()
    facts = {"namespaces": namespaces, "pair_text": pair_text, "report": report}
    return {(r.scenario, r.target): r for r in suite.results}, facts


@pytest.mark.parametrize("target", ["leasekit", "stock"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_verdict_on_two_ssh_hosts_is_the_catalogs(two_host_run, name, target):
    if target not in TARGETS:
        pytest.skip(f"{target} not in LEASEKIT_TWO_HOSTS_TARGETS")
    if name not in _selected():
        pytest.skip(f"{name} not in LEASEKIT_TWO_HOSTS_SCENARIOS")
    if target not in find_scenario(name).topology.targets:
        pytest.skip(f"{name} does not run on {target}")
    results, _ = two_host_run
    result = results[(name, target)]
    assert not result.summary.startswith("harness error"), result.summary + "\n" + "\n".join(result.notes)
    assert result.verdict == result.expected and result.as_expected, f"{name}/{target}: {result.verdict} ({result.summary})"


def test_the_run_used_two_ssh_hosts_and_left_nothing(two_host_run):
    _, facts = two_host_run
    assert "[hosts.prefill]" in facts["pair_text"] and "known_hosts" in facts["pair_text"]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [ns for ns in facts["namespaces"] if ns in listed]
    assert facts["report"]["status"] == "completed", facts["report"].get("error")


@pytest.fixture(scope="module")
def decode_host(tmp_path_factory):
    """The ``decode`` SSH host of a two-host deployment (no servers), and a stand-in server on it:
    a process group whose second process is titled like vLLM's engine core."""
    from types import SimpleNamespace

    from leasekit.cluster.remote import host_for

    with TwoHostDeployment(tmp_path_factory.mktemp("bare")) as deployment:
        host = host_for("decode", deployment.pair.host("decode"))
        pgid = host.spawn(["bash", "-c", "(exec -a VLLM::EngineCore sleep 300) & sleep 300"], name="standin")
        server = SimpleNamespace(host=host, proc=SimpleNamespace(pid=pgid), spec=SimpleNamespace(name="decode"),
                                 pids=lambda: host.group_pids(pgid))
        assert wait_until(lambda: len(host.group_pids(pgid)) >= 3, 10)
        yield server, deployment


def test_stalls_on_the_host_stop_and_freeze_then_resume(decode_host):
    from leasekit.chaos.faults.onhost import HostFreezerStall, HostSigstopStall, thread_states

    server, _ = decode_host
    stop = HostSigstopStall(server)
    stop.inject()
    assert stop.record["all_threads_stopped"]
    stop.recover()
    assert all(s != "T" for states in thread_states(server.host, server.pids()).values() for s in states)
    freeze = HostFreezerStall(server, timeout_s=20)
    freeze.inject()
    assert freeze.record["frozen"] and freeze.record["cgroup"]
    freeze.cleanup()
    assert freeze.record["host_record"]["done"] and server.host.run(["test", "-d", freeze.record["cgroup"]])[0] != 0


def test_kill_of_the_engine_core_on_the_host_leaves_the_rest(decode_host):
    from leasekit.chaos.faults.kill import signal_engine_core

    server, _ = decode_host
    before = server.pids()
    killed = signal_engine_core(server, signal.SIGKILL)
    assert len(killed) == 1 and killed[0] in before
    assert wait_until(lambda: killed[0] not in server.pids(), 5) and server.pids()
