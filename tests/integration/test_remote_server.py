"""A real vLLM server (the tiny model, stock connector) started over SSH on a testbed host with the
command line VllmServer builds: it runs in that host's namespace, answers /health at the host's
address, and stop() ends its whole group there and copies its log back."""

import subprocess
import sys

import httpx
import pytest

from leasekit.cluster.model import write_tiny_llama
from leasekit.cluster.remote import RemoteVllmServer
from leasekit.cluster.server import ServerSpec
from leasekit.cluster.sshd import SshServer
from leasekit.cluster.testbed import Testbed

pytestmark = [pytest.mark.hosts, pytest.mark.pair]


def test_remote_server_starts_on_the_host_and_stops_leaving_nothing(vllm_available, tmp_path):
    with Testbed(["decode"]) as testbed, SshServer(testbed.address("decode"), namespace=testbed.namespace("decode")) as sshd:
        address = testbed.address("decode")
        host = sshd.ssh_host("decode", python=sys.executable)
        spec = ServerSpec(name="decode", role="decode", connector="stock", model_dir=write_tiny_llama(tmp_path / "model"),
                          bind_host="0.0.0.0", url_host=address, side_channel_host=address, cpu=0)
        server = RemoteVllmServer(spec, host, tmp_path / "pairs" / "01-stock")
        try:
            server.start()
            server.wait_healthy(240)
            assert server.url == f"http://{address}:{server.http_port}"
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
            leader = server.api_server_pid()
            identify = subprocess.run(["ip", "netns", "identify", str(leader)], capture_output=True, text=True, check=True)
            assert identify.stdout.strip() == testbed.namespace("decode")
            pids = server.pids()
            assert len(pids) >= 2  # API server and engine core
            server.stop(grace_s=10)
            assert not server.pids() and not server.alive()
            assert "vllm" in server.log_path.read_text(errors="replace").lower()
        finally:
            server.stop(grace_s=2)
            report = host.teardown()
        assert host.run_dir in report.removed
