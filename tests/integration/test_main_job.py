"""The chaos CLI end to end on a real P/D pair (subprocess): ``leasekit chaos run kill-decode``, and
Ctrl-C at the worst moment of an ``--all`` run: a freezer cgroup, a network namespace and an nftables
rule in force, and D just killed."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from leasekit.lease import LeaseTiming, reclaim_bound
from leasekit.telemetry.lease_timeline import read_leases

pytestmark = [pytest.mark.pair, pytest.mark.chaos]
LEASEKIT = str(Path(sys.executable).with_name("leasekit"))


def processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if text in cmd or (proc.info["cwd"] or "").startswith(text):  # engine processes rename themselves
                found.append(proc)
        except psutil.Error:
            continue
    return [p for p in found if p.pid != os.getpid()]


def start_until(argv: list[str], moment: str, timeout_s: float = 600) -> subprocess.Popen:
    """Start the CLI and return once a progress line (stderr) contains ``moment``.

    Raises:
        AssertionError: it never did (the last progress lines are in the message; the CLI is killed).
    """
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    ready = threading.Event()

    def read_progress():
        for line in proc.stderr:
            seen.append(line)
            if moment in line:
                ready.set()

    threading.Thread(target=read_progress, daemon=True).start()
    if not ready.wait(timeout_s):
        proc.kill()
        raise AssertionError("".join(seen)[-3000:])
    return proc


def interrupt(proc: subprocess.Popen, run_dir: Path) -> dict:
    """SIGINT the CLI; it must exit 130 and leave an "interrupted" report; returns the report."""
    try:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-2000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "interrupted", report
    return report


def test_kill_decode_passes_with_spans_inside_the_bound(vllm_available, tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run([LEASEKIT, "chaos", "run", "kill-decode", "--target", "leasekit", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "kill-decode / leasekit: PASS" in done.stdout
    for column in ("last HB", "fault", "not before", "reclaimed", "bound", "margin"):
        assert column in done.stdout
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed" and report["verdict"] == "PASS"
    assert report["matrix"] == {"kill-decode": {"leasekit": {"verdict": "PASS", "expected": "PASS", "mode": "pull",
                                                                  "vllm_release": "0.32.0"}}}  # measured: GET /version
    (result,) = report["results"]
    (kill,) = result["faults"]
    assert kill["signal"] == "SIGKILL" and kill["survivors"] == []
    assert result["steady_state"]["verdict"] == "PASS"
    assert Path(result["plot"]).stat().st_size > 10_000  # the timeline PNG
    junit = (run_dir / "junit.xml").read_text()
    assert 'classname="leasekit" name="kill-decode"' in junit and "<failure" not in junit and "<error" not in junit

    # Read P's spans ourselves (not the runner's verdicts): grant, extends, an expired end in bound.
    (pair_dir,) = report["pairs"]
    leases = {lease.request_id: lease for lease in read_leases(Path(pair_dir) / "spans")[0]}
    timing = LeaseTiming.from_lease_duration(6)
    for rid in result["request_ids"]:
        lease = leases[rid]
        names = [name for name, _ in lease.events]
        assert names[0] == "grant" and names[-1] == "expire" and "extend" in names
        assert lease.outcome == "expired" and lease.heartbeat_count >= 1
        assert lease.end_s <= reclaim_bound(timing, lease.grant_s, lease.last_heartbeat_s, 0.5)
        assert lease.end_s >= lease.last_heartbeat_s + timing.extension_s - 1e-3
    released = [lease for lease in leases.values() if lease.request_id not in result["request_ids"] and lease.outcome == "released"]
    assert len(released) >= 4 and all(lease.retrievals == 1 for lease in released)  # the steady state
    assert not processes_mentioning(str(run_dir.resolve()))


TEARDOWN_PROBE = """
name = "teardown-probe"
description = "a partition, a freezer stall and a killed D at once, to be interrupted"
incident = "K11"
[topology]
targets = ["leasekit"]
[launch]
network_namespace = true
[steady_state]
enabled = false
[[faults]]
kind = "partition"
target = "prefill"
after_s = 0
duration_s = 120
[[faults]]
kind = "kill"
target = "decode"
after_s = 1
[[faults]]
kind = "stall"
method = "freezer"
target = "prefill"
after_s = 2
duration_s = 120
[expect]
checks = ["liveness"]
"""


def leftovers() -> dict[str, list[str]]:
    """Everything of leasekit's a run can leave on the host: namespaces (and the nftables rules in
    them), veth links, cgroups, and host nftables tables."""
    from leasekit.chaos.faults._cgroup import leftover_cgroups
    from leasekit.chaos.faults.netns import list_leftovers

    found = list_leftovers()
    found["cgroups"] = [str(path) for _, path, _ in leftover_cgroups()]
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    found["host nft tables"] = [t for t in tables.splitlines() if "leasekit" in t]
    return found


def test_interrupted_all_leaves_no_process_namespace_rule_or_cgroup(vllm_available, tmp_path):
    """``--all`` over a catalog whose scenario holds a network namespace, an nftables rule and a
    frozen cgroup (P's) at once, D killed just before while P held the leases of D's queue; SIGINT
    (Ctrl-C) while all are in force: the report is "interrupted", every fault's record survives (the
    kill's too), and nothing of them, no process included, may survive."""
    assert not any(leftovers().values()), leftovers()  # a clean start, or the test proves nothing
    catalog = tmp_path / "catalog"
    catalog.mkdir()
    (catalog / "teardown-probe.toml").write_text(TEARDOWN_PROBE)
    run_dir = (tmp_path / "run").resolve()
    proc = start_until([LEASEKIT, "chaos", "run", "--all", "--catalog", str(catalog), "--run-dir", str(run_dir)],
                       "stopped (freezer)")  # faults run in time order: the kill went out before
    try:
        time.sleep(1.0)
        during = leftovers()
        assert during["namespaces"] and during["cgroups"], during
        # P and D sit on two hosts of a testbed (a namespace each); the rule lies in P's, whichever is listed first
        rulesets = {ns: subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "ruleset"],
                                       capture_output=True, text=True).stdout for ns in during["namespaces"]}
        assert any(" drop" in ruleset for ruleset in rulesets.values()), rulesets
        servers = processes_mentioning(str(run_dir))
        assert len(servers) >= 3  # API server, engine core and worker of P (D's were killed)
    finally:
        report = interrupt(proc, run_dir)
    assert report["verdict"] == "UNKNOWN"
    (result,) = report["results"]
    assert result["verdict"] == "UNKNOWN" and "interrupted" in " ".join(result["notes"])
    assert result["request_ids"]  # the kill had been sent: the workload's record must survive too
    assert sorted(f["kind"] for f in result["faults"]) == ["freezer", "kill", "nft"]
    (kill,) = [f for f in result["faults"] if f["kind"] == "kill"]
    assert kill["signal"] == "SIGKILL" and kill["injected_monotonic_s"] is not None
    psutil.wait_procs(servers, timeout=10)
    assert not [p for p in servers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not processes_mentioning(str(run_dir))
    assert not any(leftovers().values()), leftovers()
