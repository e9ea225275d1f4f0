"""vLLM's ZMQ IPC sockets of a server leasekit starts live in a directory of its own, removed when the server is
stopped (a killed vLLM cannot remove them; in vLLM's default, the system temp directory, they would pile up)."""

import os
import sys
from pathlib import Path

from leasekit.cluster import procs
from leasekit.cluster.server import VllmServer
from leasekit.cluster.serverspec import ServerSpec

# what vLLM does with VLLM_RPC_BASE_PATH (vllm/utils/network_utils.py get_open_zmq_ipc_path): a socket file in it
BIND = ("import os, socket, time; s = socket.socket(socket.AF_UNIX); "
        "s.bind(os.path.join(os.environ['VLLM_RPC_BASE_PATH'], 'engine-core')); time.sleep(60)")


def server(tmp_path: Path) -> VllmServer:
    spec = ServerSpec(name="fake-decode", role="decode", connector="stock", model_dir=tmp_path)
    srv = VllmServer(spec, run_dir=tmp_path)
    srv.command = lambda: [sys.executable, "-c", BIND]
    return srv


def test_a_killed_servers_ipc_sockets_are_removed_when_it_is_stopped(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    srv = server(tmp_path)
    srv.start()
    try:
        rpc_dir = Path(srv.rpc_dir)
        assert len(str(rpc_dir / "00000000-0000-0000-0000-000000000000")) < 108  # fits a Unix socket address
        assert procs.wait_until(lambda: (rpc_dir / "engine-core").exists(), 10)
        srv.kill()  # SIGKILL: the process cannot remove its socket
        assert (rpc_dir / "engine-core").exists()
    finally:
        srv.stop(grace_s=1)
    assert not rpc_dir.exists() and srv.rpc_dir is None


def test_a_base_path_the_caller_set_is_kept(tmp_path, monkeypatch):
    mine = tmp_path / "rpc"
    mine.mkdir()
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(mine))
    srv = server(tmp_path)
    srv.start()
    try:
        assert srv.rpc_dir is None and srv.environment()["VLLM_RPC_BASE_PATH"] == str(mine)
        assert procs.wait_until(lambda: (mine / "engine-core").exists(), 10)
    finally:
        srv.stop(grace_s=1)
    assert mine.exists() and os.environ["VLLM_RPC_BASE_PATH"] == str(mine)


def test_a_server_on_another_host_gets_a_directory_its_teardown_removes(tmp_path, monkeypatch):
    from leasekit.cluster.localhost import LocalHost
    from leasekit.cluster.remote import RemoteVllmServer

    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    with LocalHost("decode", workdir=str(tmp_path / "host"), run_name="run") as host:  # the SSH host's own code
        spec = ServerSpec(name="fake-decode", role="decode", connector="stock", model_dir=tmp_path)
        srv = RemoteVllmServer(spec, host, tmp_path / "local")
        srv.command = lambda: [host.python, "-c", BIND]
        srv.start()
        rpc_dir = Path(srv.spec.extra_env["VLLM_RPC_BASE_PATH"])
        assert rpc_dir.parent == Path("/tmp") and rpc_dir.name.startswith("lk-rpc-")
        assert procs.wait_until(lambda: (rpc_dir / "engine-core").exists(), 10)
        srv.kill()
        assert (rpc_dir / "engine-core").exists()
    assert not rpc_dir.exists()
