"""Stalls on real processes: a child bumps a counter file every 10 ms (from a second thread too);
while stalled the counter does not move and the kernel shows the stop/freeze, after recover it
moves again, and cleanup restores everything even after a failure."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leasekit.chaos.faults import FaultError, _cgroup
from leasekit.chaos.faults.stall import (
    FreezerStall,
    SigstopStall,
    cleanup_stale_cgroups,
    detect_freezer,
    list_leftovers,
    thread_states,
)
from leasekit.cluster.procs import wait_until

COUNTER = """
import os, sys, threading, time
path = sys.argv[1]
def spin():
    while True:
        time.sleep(0.01)
threading.Thread(target=spin, daemon=True).start()
n = 0
while True:
    n += 1
    with open(path + ".tmp", "w") as f:
        f.write(str(n))
    os.replace(path + ".tmp", path)
    time.sleep(0.01)
"""


class Counter:
    def __init__(self, path: Path):
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-c", COUNTER, str(path)])
        assert wait_until(lambda: self.value() > 2, 10, 0.02)

    def value(self) -> int:
        try:
            return int(self.path.read_text() or 0)
        except FileNotFoundError:
            return 0

    def is_still(self, seconds: float = 0.3) -> bool:
        before = self.value()
        time.sleep(seconds)
        return self.value() == before

    def moves(self, timeout_s: float = 3.0) -> bool:
        start = self.value()
        return wait_until(lambda: self.value() > start + 2, timeout_s, 0.02)


@pytest.fixture
def counter(tmp_path):
    c = Counter(tmp_path / "counter")
    yield c
    try:
        os.kill(c.proc.pid, signal.SIGCONT)  # never leave a stopped process behind
    except ProcessLookupError:
        pass
    c.proc.kill()
    c.proc.wait()


@pytest.fixture
def cleanups():
    """Fault objects registered here are cleaned up at teardown whatever happened."""
    faults = []
    yield faults
    for fault in faults:
        fault.cleanup()


def _backend_or_skip(*backends: str) -> None:
    found = detect_freezer(backends or _cgroup.BACKENDS)
    if found.backend is None:
        pytest.skip(f"no usable freezer here: {found.reason}")


# --- SIGSTOP --------------------------------------------------------------------------------

def test_sigstop_stops_every_thread_then_resumes(counter, cleanups):
    stall = SigstopStall(lambda: [counter.proc.pid])
    cleanups.append(stall)
    stall.inject()
    states = thread_states(counter.proc.pid)
    assert len(states) >= 2 and set(states) <= {"T"}, states
    assert stall.record["all_threads_stopped"] is True
    assert stall.record["stopped_pids"] == [counter.proc.pid]
    assert counter.is_still()
    stall.recover()
    assert counter.moves()
    assert "T" not in thread_states(counter.proc.pid)
    assert stall.record["recovered_monotonic_s"] >= stall.record["injected_monotonic_s"]
    stall.cleanup()
    stall.cleanup()


def test_sigstop_cleanup_after_a_failure_resumes(counter):
    stall = SigstopStall([counter.proc.pid])
    with pytest.raises(RuntimeError, match="boom"):
        try:
            stall.inject()
            raise RuntimeError("boom")
        finally:
            stall.cleanup()
    assert counter.moves()


def test_sigstop_validates_pids(counter):
    with pytest.raises(ValueError, match="pids"):
        SigstopStall([]).inject()
    with pytest.raises(ValueError, match="pids.*int >= 1"):
        SigstopStall([0]).inject()
    with pytest.raises(ValueError, match="settle_timeout_s"):
        SigstopStall([counter.proc.pid], settle_timeout_s=0)
    dead = subprocess.Popen(["true"])
    dead.wait()
    with pytest.raises(FaultError, match="none of the pids"):
        SigstopStall([dead.pid]).inject()


# --- cgroup freezer -------------------------------------------------------------------------

def test_detect_freezer_finds_a_working_backend():
    found = detect_freezer()
    assert found.reason
    if found.backend is not None:
        assert found.root is not None and found.root.is_dir()
    assert not list_leftovers(f"{_cgroup.PREFIX}probe-")  # the probe cleaned up after itself
    with pytest.raises(ValueError, match="prefer"):
        detect_freezer(("v3",))


@pytest.mark.parametrize("backend", ["v2", "v1"])
def test_freezer_freezes_then_thaws_and_restores_the_cgroup(counter, cleanups, backend):
    _backend_or_skip(backend)
    pid = counter.proc.pid
    origin = _cgroup.cgroup_of(pid, backend)
    stall = FreezerStall([pid], backend=backend)
    cleanups.append(stall)
    stall.inject()
    path = Path(stall.record["cgroup"])
    assert path.name == stall.cgroup_name and path.name.startswith("leasekit-")
    assert _cgroup.cgroup_of(pid, backend) == f"/{stall.cgroup_name}"
    assert _cgroup.is_frozen(backend, path) and stall.record["frozen"] is True
    if backend == "v1":
        assert (path / "freezer.state").read_text().strip() == "FROZEN"
    else:
        assert "frozen 1" in (path / "cgroup.events").read_text()
    assert counter.is_still()
    stall.recover()
    assert counter.moves()
    stall.cleanup()
    assert not path.exists()
    assert _cgroup.cgroup_of(pid, backend) == origin
    assert str(path) not in list_leftovers()
    stall.cleanup()  # idempotent
    assert counter.moves()


def test_freezer_cleanup_after_a_failure_thaws_and_removes(counter):
    _backend_or_skip()
    stall = FreezerStall([counter.proc.pid])
    with pytest.raises(RuntimeError, match="boom"):
        try:
            stall.inject()
            assert counter.is_still()
            raise RuntimeError("boom")
        finally:
            stall.cleanup()
    assert counter.moves()
    assert list_leftovers(stall.cgroup_name) == []


def test_freezer_inject_failure_leaves_nothing(counter):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stall = FreezerStall([dead.pid])
    _backend_or_skip()
    with pytest.raises(FaultError, match="none of the pids"):
        stall.inject()
    assert list_leftovers(stall.cgroup_name) == []


def test_cleanup_stale_cgroups_recovers_a_crashed_run(counter):
    _backend_or_skip()
    stall = FreezerStall([counter.proc.pid])
    try:
        stall.inject()  # then "crash": nobody calls cleanup on this object
        assert list_leftovers(stall.cgroup_name) == [stall.record["cgroup"]]
        assert cleanup_stale_cgroups(stall.cgroup_name) == [stall.record["cgroup"]]
        assert list_leftovers(stall.cgroup_name) == []
        assert counter.moves()
    finally:
        stall.cleanup()  # harmless now: the cgroup is already gone
    assert list_leftovers(stall.cgroup_name) == []


def test_freezer_argument_errors(counter):
    with pytest.raises(ValueError, match="backend"):
        FreezerStall([counter.proc.pid], backend="v3")
    with pytest.raises(ValueError, match="timeout_s"):
        FreezerStall([counter.proc.pid], timeout_s=-1)
    with pytest.raises(ValueError, match="prefix must start with 'leasekit-'"):
        cleanup_stale_cgroups("docker")
