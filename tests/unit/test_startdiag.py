"""The start diagnosis written when a server is not healthy in time (leasekit/cluster/startdiag.py),
on real processes: a busy one must show up as the busiest, a sleeping one with its state."""

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from leasekit.cluster import procs, startdiag


def test_last_log_stamp_is_the_last_vllm_time_stamp():
    log = "(EngineCore pid=1) INFO 12-01 06:12:20 [core.py:1] x\nnoise 99-99\n(APIServer pid=2) INFO 12-01 06:17:23 [entry.py:140] y\n"
    assert startdiag.last_log_stamp(log) == "12-01 06:17:23"
    assert startdiag.last_log_stamp("no stamps here") is None


@pytest.fixture
def spinner():
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield proc
    proc.kill()
    proc.wait()


def test_busiest_processes_name_a_spinning_process(spinner):
    rows = startdiag.top_cpu_processes(sample_s=1.0, limit=12)  # a busy host may have other spinners
    (row,) = [row for row in rows if f"pid {spinner.pid} " in row]
    assert float(row.split(" cpu ", 1)[1].split("%", 1)[0]) > 20.0, row  # a real share of a core, not 0.0


def test_diagnosis_names_the_server_processes_and_never_raises(tmp_path: Path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        sleeper.stdout.readline()
        assert procs.wait_until(lambda: psutil.Process(sleeper.pid).status() == "sleeping", 10)
        log = tmp_path / "decode.log"
        log.write_text("(APIServer pid=1) INFO 12-01 06:17:23 [entry.py:140] Starting\n")
        text = startdiag.diagnose_start("decode", [sleeper.pid, 999_999_999], log)
    finally:
        sleeper.kill()
        sleeper.wait()
        sleeper.stdout.close()
    assert "last time stamp in decode.log: 12-01 06:17:23" in text
    assert f"decode pid {sleeper.pid}: sleeping" in text
    assert "decode pid 999999999:" in text  # a vanished pid is reported, not raised
    assert "busiest processes on the host:" in text
    stacks = tmp_path / "decode.stacks.txt"
    if startdiag._py_spy() is not None:
        assert "Python stacks" in text and f"pid {sleeper.pid}" in stacks.read_text()
    else:
        assert "no py-spy here" in text


def test_free_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    """A port the kernel could hand to a bind(0) in the meantime (vLLM's own ZMQ sockets) is never
    chosen: that collision stopped a stock D's handshake listener in CI (leasekit/cluster/procs.py)."""
    import socket

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = [procs.free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(port < low for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))  # free when handed out
