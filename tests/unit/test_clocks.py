"""Clock domains: a process in a real time namespace has its monotonic clock shifted by the offset
the kernel publishes, and to_process_monotonic converts by that measured offset."""

import shutil
import subprocess
import sys
import time

import pytest

from leasekit.cluster.clocks import monotonic_namespace_offset_s, to_process_monotonic


def test_missing_process_is_an_error():
    with pytest.raises(ProcessLookupError):
        monotonic_namespace_offset_s(2**22 + 12345)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare not installed")
def test_time_namespace_offset_is_measured_and_converted():
    code = "import time,sys; print(time.monotonic(), flush=True); time.sleep(5)"
    proc = subprocess.Popen(
        ["unshare", "--time", "--fork", "--monotonic=1000", sys.executable, "-c", code],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        child_now = float(proc.stdout.readline())
        our_now = time.monotonic()
        child = next(c for c in __import__("psutil").Process(proc.pid).children() if c.name().startswith("python"))
        assert monotonic_namespace_offset_s(child.pid) == pytest.approx(1000.0)
        # the child's clock reading, converted from ours, agrees within scheduling noise
        assert to_process_monotonic(our_now, child.pid) == pytest.approx(child_now, abs=1.0)
    finally:
        proc.kill()
        proc.wait()
