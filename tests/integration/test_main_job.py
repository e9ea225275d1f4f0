"""The main job end to end: ``leasekit chaos run kill-decode`` on a real P/D pair (CLI subprocess)."""

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

from leasekit.chaos.leases import read_leases
from leasekit.lease import LeaseTiming, reclaim_bound

pytestmark = [pytest.mark.pair, pytest.mark.chaos]
LEASEKIT = str(Path(sys.executable).with_name("leasekit"))


def processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if text in cmd or (proc.info["cwd"] or "") == text:
                found.append(proc)
        except psutil.Error:
            continue
    return [p for p in found if p.pid != os.getpid()]


def test_kill_decode_passes_with_spans_inside_the_bound(vllm_available, tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run([LEASEKIT, "chaos", "run", "kill-decode", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "kill-decode: PASS" in done.stdout
    for column in ("last HB", "fault", "not before", "reclaimed", "bound", "margin"):
        assert column in done.stdout
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed" and report["verdict"] == "PASS"
    steady, fault = report["phases"]
    assert fault["fault"]["signal"] == "SIGKILL" and fault["fault"]["survivors"] == []

    # Read P's spans ourselves (not the runner's verdicts): grant, extends, an expired end in bound.
    leases = {lease.request_id: lease for lease in read_leases(run_dir / "spans")[0]}
    timing = LeaseTiming.from_lease_duration(6)
    for rid in fault["request_ids"]:
        lease = leases[rid]
        names = [name for name, _ in lease.events]
        assert names[0] == "grant" and names[-1] == "expire" and "extend" in names
        assert lease.outcome == "expired" and lease.heartbeat_count >= 1
        assert lease.end_s <= reclaim_bound(timing, lease.grant_s, lease.last_heartbeat_s, 0.5)
        assert lease.end_s >= lease.last_heartbeat_s + timing.extension_s - 1e-3
    for rid in steady["request_ids"]:
        assert leases[rid].outcome == "released" and leases[rid].retrievals == 1
    assert not processes_mentioning(str(run_dir.resolve()))


@pytest.mark.parametrize("moment, delay_s", [("steady state:", 3.0), ("fault:", 0.3)])
def test_sigint_mid_scenario_tears_down_and_reports_interrupted(vllm_available, tmp_path, moment, delay_s):
    """Ctrl-C while leases are held (steady state), and right after the kill went out (fault)."""
    run_dir = (tmp_path / "run").resolve()
    proc = subprocess.Popen([LEASEKIT, "chaos", "run", "kill-decode", "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    ready = threading.Event()

    def read_progress():
        for line in proc.stderr:
            seen.append(line)
            if moment in line:
                ready.set()

    threading.Thread(target=read_progress, daemon=True).start()
    try:
        assert ready.wait(600), "".join(seen)[-3000:]
        servers = processes_mentioning(str(run_dir))
        assert len(servers) >= 3  # API server, engine core and worker of P (and of D before the kill)
        time.sleep(delay_s)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-2000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "interrupted" and report["verdict"] == "UNKNOWN"
    last = report["phases"][-1]
    assert last["request_ids"] and "interrupted" in " ".join(last["notes"])
    if moment == "fault:":  # the kill had been sent: its record must survive the interruption
        assert last["name"] == "fault" and last["fault"]["signal"] == "SIGKILL"
        assert last["fault"]["injected_monotonic_s"] is not None
    psutil.wait_procs(servers, timeout=10)
    assert not [p for p in servers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not processes_mentioning(str(run_dir))
