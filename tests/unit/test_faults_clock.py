"""Launch-time clock shifts (:mod:`leasekit.cluster.clockshift`) on real processes: a Python child
under a time namespace sees its monotonic clocks shifted and the wall clock not; under libfaketime
the reverse."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from leasekit.cluster import clockshift as clock
from leasekit.cluster.clockshift import (
    ClockShiftError,
    faketime_env,
    faketime_spec,
    time_namespace_prefix,
)
from leasekit.cluster.procs import wait_until

REPORT = "import json, time; print(json.dumps([time.monotonic(), time.perf_counter(), time.time()]))"


def _run(prefix: list[str], env: dict | None = None, code: str = REPORT) -> tuple[list[float], list[float]]:
    """Run ``code`` in a child; return (child readings, parent readings at the same moment)."""
    parent_before = [time.monotonic(), time.perf_counter(), time.time()]
    out = subprocess.run([*prefix, sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=30, check=False)
    parent_after = [time.monotonic(), time.perf_counter(), time.time()]
    assert out.returncode == 0, out.stderr
    child = json.loads(out.stdout.strip().splitlines()[-1])
    # the child read its clocks somewhere in between: compare with the midpoint
    return child, [(a + b) / 2 for a, b in zip(parent_before, parent_after)]


# --- time namespace -------------------------------------------------------------------------

@pytest.mark.parametrize("offset", [1000, -100])
def test_time_namespace_shifts_monotonic_not_wall(offset):
    child, parent = _run(time_namespace_prefix(offset))
    assert child[0] - parent[0] == pytest.approx(offset, abs=1.0)  # time.monotonic
    assert child[1] - parent[1] == pytest.approx(offset, abs=1.0)  # time.perf_counter
    assert child[2] == pytest.approx(parent[2], abs=1.0)           # time.time unchanged


def test_time_namespace_prefix_shape_and_kill_child():
    prefix = time_namespace_prefix(5, boottime_offset_s=7)
    assert prefix[1:] == ["--time", "--fork", "--kill-child", "--monotonic=5", "--boottime=7"]
    outer = subprocess.Popen([*prefix, "sleep", "60"])
    try:
        assert wait_until(lambda: len(psutil.Process(outer.pid).children()) == 1, 10, 0.05)
        (inner,) = psutil.Process(outer.pid).children()
        outer.send_signal(signal.SIGKILL)  # killing the prefix kills the command (--kill-child)
        outer.wait(timeout=5)
        psutil.wait_procs([inner], timeout=5)
        assert not inner.is_running() or inner.status() == psutil.STATUS_ZOMBIE
    finally:
        outer.kill()
        outer.wait()


def test_time_namespace_offsets_are_validated():
    uptime = time.clock_gettime(time.CLOCK_MONOTONIC)
    for bad, message in [
        (1.5, "whole number of seconds"),
        (math.nan, "finite"),
        (True, "finite number"),
        ("10", "finite number"),
        (clock.MAX_OFFSET_S + 1, "monotonic_offset_s must be in"),
        (-(math.ceil(uptime) + 10), "may not go below 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            time_namespace_prefix(bad)
    with pytest.raises(ValueError, match="boottime_offset_s"):
        time_namespace_prefix(10, boottime_offset_s=0.25)
    assert time_namespace_prefix(10.0)[-2:] == ["--monotonic=10", "--boottime=10"]


# --- libfaketime ----------------------------------------------------------------------------

def test_faketime_shifts_wall_not_monotonic_and_sleep_works():
    env = {**os.environ, **faketime_env(3600)}
    assert env["FAKETIME"] == "+3600" and env["FAKETIME_DONT_FAKE_MONOTONIC"] == "1"
    code = "import time; time.sleep(0.05); " + REPORT
    child, parent = _run([], env, code)
    assert child[2] - parent[2] == pytest.approx(3600, abs=1.0)  # time.time shifted
    assert child[0] == pytest.approx(parent[0], abs=1.0)          # time.monotonic real
    assert child[1] == pytest.approx(parent[1], abs=1.0)          # time.perf_counter real


def test_faketime_rate_speeds_the_wall_clock_only():
    env = {**os.environ, **faketime_env(-86400.5, rate=2)}
    code = ("import json, time\n"
            "w, m = time.time(), time.perf_counter()\n"
            "time.sleep(1.0)\n"
            "print(json.dumps([time.time() - w, time.perf_counter() - m, w]))\n")
    (wall_elapsed, mono_elapsed, wall_start), parent = _run([], env, code)
    assert mono_elapsed == pytest.approx(1.0, abs=0.3)
    assert wall_elapsed == pytest.approx(2.0, abs=0.4)
    assert wall_start - parent[2] == pytest.approx(-86400.5, abs=2.0)


def test_faketime_without_the_sleep_fix_still_shifts_the_wall_clock():
    env_vars = faketime_env(600, sleep_fix=False)
    assert env_vars["LD_PRELOAD"] == clock.find_libfaketime()
    child, parent = _run([], {**os.environ, **env_vars})
    assert child[2] - parent[2] == pytest.approx(600, abs=1.0)


def test_faketime_spec_and_validation(monkeypatch):
    assert faketime_spec(3600) == "+3600"
    assert faketime_spec(-1.5, 2) == "-1.5 x2"
    assert faketime_spec(0, 0.5) == "+0 x0.5"
    for kwargs, message in [
        ({"offset_s": math.inf}, "offset_s must be a finite number"),
        ({"offset_s": -time.time() - 10}, "offset_s"),
        ({"rate": 0}, r"rate must be a number in 0.001..1000"),
        ({"rate": math.nan}, "rate"),
        ({"rate": 5000}, "rate"),
    ]:
        with pytest.raises(ValueError, match=message):
            faketime_env(**kwargs)
    monkeypatch.setattr(clock, "LIBFAKETIME_GLOBS", ("/nonexistent/{lib}",))
    with pytest.raises(ClockShiftError, match="Debian package `faketime`"):
        faketime_env(10)
