"""The Toxiproxy client against a stand-in HTTP server that implements just the endpoints it uses
(records every request, answers like Toxiproxy), and against a real Toxiproxy when
``TOXIPROXY_URL`` is set (GPU CI)."""

import json
import os
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from leasekit.chaos.faults.toxiproxy import (
    ToxiproxyClient,
    ToxiproxyError,
    ToxiproxyFault,
)


class _StandIn(BaseHTTPRequestHandler):
    """Toxiproxy's API, minimally: proxies and toxics kept in memory on the server object."""

    def log_message(self, *args):  # keep test output clean
        pass

    def _reply(self, status: int, body=None):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        state = self.server.state
        state["requests"].append((method, self.path, body))
        parts = [p for p in self.path.split("/") if p]
        proxies = state["proxies"]
        if method == "POST" and parts == ["proxies"]:
            if body["name"] in proxies:
                return self._reply(409, {"error": "proxy already exists", "status": 409})
            proxies[body["name"]] = {**body, "toxics": {}}
            return self._reply(201, {**body, "toxics": []})
        if len(parts) < 2 or parts[0] != "proxies" or parts[1] not in proxies:
            return self._reply(404, {"error": "proxy not found", "status": 404})
        proxy = proxies[parts[1]]
        if method == "POST" and len(parts) == 2:
            proxy.update(body)
            return self._reply(200, {k: v for k, v in proxy.items() if k != "toxics"})
        if method == "DELETE" and len(parts) == 2:
            del proxies[parts[1]]
            return self._reply(204)
        if method == "POST" and parts[2:] == ["toxics"]:
            if body["name"] in proxy["toxics"]:
                return self._reply(409, {"error": "toxic already exists", "status": 409})
            proxy["toxics"][body["name"]] = body
            return self._reply(200, body)
        if method == "DELETE" and len(parts) == 4 and parts[2] == "toxics":
            if proxy["toxics"].pop(parts[3], None) is None:
                return self._reply(404, {"error": "toxic not found", "status": 404})
            return self._reply(204)
        return self._reply(405, {"error": "not implemented in the stand-in", "status": 405})

    def do_POST(self):
        self._handle("POST")

    def do_DELETE(self):
        self._handle("DELETE")


@pytest.fixture
def standin():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    server.state = {"requests": [], "proxies": {}}
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    client = ToxiproxyClient(f"http://127.0.0.1:{server.server_address[1]}")
    yield client, server.state
    client.close()
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_client_sends_toxiproxy_requests(standin):
    client, state = standin
    proxy = client.create_proxy("decode_nixl", "127.0.0.1:0", "127.0.0.1:5600")
    assert proxy["upstream"] == "127.0.0.1:5600"
    toxic = client.add_toxic("decode_nixl", "latency", {"latency": 500, "jitter": 10}, toxicity=0.5)
    assert toxic["name"] == "latency_downstream"
    client.set_enabled("decode_nixl", False)
    client.remove_toxic("decode_nixl", "latency_downstream")
    client.delete_proxy("decode_nixl")
    assert state["requests"] == [
        ("POST", "/proxies", {"name": "decode_nixl", "listen": "127.0.0.1:0",
                              "upstream": "127.0.0.1:5600", "enabled": True}),
        ("POST", "/proxies/decode_nixl/toxics", {"name": "latency_downstream", "type": "latency",
                                                  "stream": "downstream", "toxicity": 0.5,
                                                  "attributes": {"latency": 500, "jitter": 10}}),
        ("POST", "/proxies/decode_nixl", {"enabled": False}),
        ("DELETE", "/proxies/decode_nixl/toxics/latency_downstream", None),
        ("DELETE", "/proxies/decode_nixl", None),
    ]
    assert state["proxies"] == {}


def test_server_errors_carry_status_and_message(standin):
    client, _ = standin
    client.create_proxy("p", "127.0.0.1:0", "127.0.0.1:1")
    with pytest.raises(ToxiproxyError, match="HTTP 409: proxy already exists") as info:
        client.create_proxy("p", "127.0.0.1:0", "127.0.0.1:1")
    assert info.value.status == 409
    with pytest.raises(ToxiproxyError, match="404"):
        client.remove_toxic("p", "nope")


def test_unreachable_server_is_a_clear_error():
    with socket.socket() as sock:  # a port with nobody listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = ToxiproxyClient(f"http://127.0.0.1:{port}", timeout_s=1)
    with pytest.raises(ToxiproxyError, match="no answer") as info:
        client.create_proxy("p", "127.0.0.1:0", "127.0.0.1:1")
    assert info.value.status == 0
    client.close()


def test_fault_injects_recovers_and_cleans_up(standin):
    client, state = standin
    client.create_proxy("p", "127.0.0.1:0", "127.0.0.1:1")
    fault = ToxiproxyFault(client, "p", "timeout", {"timeout": 0}, stream="upstream")
    try:
        fault.inject()
        assert list(state["proxies"]["p"]["toxics"]) == ["leasekit_timeout_upstream"]
        assert fault.record["kind"] == "toxiproxy" and fault.record["stream"] == "upstream"
        assert fault.record["applied_monotonic_s"] >= fault.record["injected_monotonic_s"]
        fault.recover()
        assert state["proxies"]["p"]["toxics"] == {}
        fault.inject()
        state["proxies"]["p"]["toxics"].clear()  # someone else removed it: cleanup must not fail
    finally:
        fault.cleanup()
        fault.cleanup()
    assert state["proxies"]["p"]["toxics"] == {}


def test_arguments_are_validated(standin):
    client, state = standin
    cases = [
        (lambda: client.add_toxic("p", "packet_loss"), "type must be one of"),
        (lambda: client.add_toxic("p", "latency", stream="sideways"), "stream must be one of"),
        (lambda: client.add_toxic("p", "latency", toxicity=1.5), r"toxicity must be a number in 0.0..1.0"),
        (lambda: client.add_toxic("p", "latency", attributes=[1]), "attributes must be a dict"),
        (lambda: client.create_proxy("bad name", "127.0.0.1:0", "x:1"), "name must be"),
        (lambda: client.create_proxy("p", "127.0.0.1", "x:1"), "listen must be 'host:port'"),
        (lambda: client.create_proxy("p", "127.0.0.1:0", "x:70000"), "upstream"),
        (lambda: ToxiproxyClient("localhost:8474"), "url must start with"),
        (lambda: ToxiproxyFault(client, "p", "latency", toxicity=-0.1), "toxicity"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert state["requests"] == []  # nothing invalid reached the server


def test_from_env(monkeypatch):
    monkeypatch.delenv("TOXIPROXY_URL", raising=False)
    assert ToxiproxyClient.from_env() is None
    monkeypatch.setenv("TOXIPROXY_URL", "http://127.0.0.1:8474/")
    client = ToxiproxyClient.from_env()
    assert client is not None and client.url == "http://127.0.0.1:8474"
    client.close()


@pytest.mark.skipif(not os.environ.get("TOXIPROXY_URL"), reason="TOXIPROXY_URL not set (no Toxiproxy server here)")
def test_real_toxiproxy_latency_toxic():
    """Against a real Toxiproxy: proxy a local echo server and measure the latency toxic."""
    echo = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        echo.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = echo.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(conn.recv(64))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = ToxiproxyClient.from_env()
    name = f"leasekit_test_{uuid.uuid4().hex[:8]}"
    proxy = client.create_proxy(name, "127.0.0.1:0", f"127.0.0.1:{echo.getsockname()[1]}")
    fault = ToxiproxyFault(client, name, "latency", {"latency": 300})
    try:
        host, port = proxy["listen"].rsplit(":", 1)

        def round_trip() -> float:
            t0 = time.monotonic()
            with socket.create_connection((host, int(port)), timeout=5) as conn:
                conn.sendall(b"ping")
                assert conn.recv(64) == b"ping"
            return time.monotonic() - t0

        assert round_trip() < 0.25
        fault.inject()
        assert round_trip() >= 0.3
        fault.recover()
        assert round_trip() < 0.25
    finally:
        fault.cleanup()
        client.delete_proxy(name)
        client.close()
        stop.set()
        thread.join(2)
        echo.close()
