"""KillFault on real process groups: a real VllmServer object whose process is a plain shell group
with one child titled like vLLM's engine core (no vLLM started)."""

import signal
import subprocess
import sys

import psutil
import pytest

from leasekit.chaos.faults import FaultError, KillFault, find_engine_core_pids
from leasekit.cluster import procs
from leasekit.cluster.server import VllmServer
from leasekit.cluster.serverspec import ServerSpec

# the shell's children: a plain sleep and one whose argv[0] is the engine-core title
GROUP_SCRIPT = "sleep 60 & (exec -a 'VLLM::EngineCore' sleep 60) & wait"
PLAIN_SCRIPT = "sleep 60 & sleep 61 & wait"


def _server(tmp_path, script: str) -> VllmServer:
    spec = ServerSpec(name="fake-decode", role="decode", connector="stock", model_dir=tmp_path)
    server = VllmServer(spec, run_dir=tmp_path)
    server.proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    assert procs.wait_until(lambda: len(server.pids()) == 3, 10), server.pids()
    return server


@pytest.fixture
def group_server(tmp_path):
    server = _server(tmp_path, GROUP_SCRIPT)
    # the subshell is forked before it execs under its new name: wait until the name shows (a loaded host
    # once ran the test in between, finding no engine core)
    assert procs.wait_until(lambda: len(find_engine_core_pids(server.pids())) == 1, 10), server.pids()
    yield server
    server.stop(grace_s=1)


@pytest.fixture
def plain_server(tmp_path):
    server = _server(tmp_path, PLAIN_SCRIPT)
    yield server
    server.stop(grace_s=1)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_engine_core_scope_kills_only_the_engine_core(group_server):
    before = group_server.pids()
    (core,) = find_engine_core_pids(before)
    assert psutil.Process(core).cmdline()[0] == "VLLM::EngineCore"
    fault = KillFault(group_server, scope="engine_core")
    fault.inject()
    assert fault.record["engine_core_pids"] == [core]
    assert fault.record["pids"] == [core]
    assert fault.record["scope"] == "engine_core" and fault.record["signal"] == "SIGKILL"
    assert fault.record["survivors"] == []
    assert isinstance(fault.record["injected_monotonic_s"], float)
    assert isinstance(fault.record["injected_wall_s"], float)
    assert not _alive(core)
    assert all(_alive(pid) for pid in before if pid != core)
    fault.cleanup()
    fault.cleanup()  # idempotent
    assert not any(_alive(pid) for pid in before)


def test_group_scope_kills_every_process(group_server):
    before = group_server.pids()
    fault = KillFault(group_server, signal.SIGKILL)
    fault.inject()
    assert sorted(fault.record["pids"]) == before
    assert fault.record["survivors"] == []
    assert not any(_alive(pid) for pid in before)
    with pytest.raises(RuntimeError, match="not running"):
        fault.inject()


def test_engine_core_missing_is_a_clear_error_and_kills_nothing(plain_server):
    before = plain_server.pids()
    fault = KillFault(plain_server, scope="engine_core")
    with pytest.raises(FaultError, match="VLLM::EngineCore"):
        fault.inject()
    assert all(_alive(pid) for pid in before)


def test_engine_core_found_by_process_name():
    # setproctitle-style: comm (psutil name) set via prctl(PR_SET_NAME), truncated to 15 bytes
    code = (
        "import ctypes, time\n"
        "ctypes.CDLL('libc.so.6').prctl(15, b'VLLM::EngineCore', 0, 0, 0)\n"
        "print('ok', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ok"
        assert psutil.Process(proc.pid).name() == "VLLM::EngineCor"
        assert find_engine_core_pids([proc.pid, 1]) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert find_engine_core_pids([proc.pid]) == []  # gone processes are skipped


def test_bad_scope_names_the_field(tmp_path):
    spec = ServerSpec(name="x", role="decode", connector="stock", model_dir=tmp_path)
    with pytest.raises(ValueError, match="scope must be one of"):
        KillFault(VllmServer(spec, tmp_path), scope="workers")
