"""Transfer mode of the servers leasekit starts (pull: NixlConnector / LeaseKitConnector; push: vLLM's
NixlPushConnector / LeaseKitPushConnector), and the router's shared ``X-Request-Id`` that push mode needs."""

from __future__ import annotations

import json

import httpx
import pytest

from leasekit.cluster.pair import PairSpec, PDPair
from leasekit.cluster.router import Router, new_routing_id
from leasekit.cluster.serverspec import ServerSpec


def _spec(tmp_path, **kwargs) -> ServerSpec:
    kwargs.setdefault("connector", "stock")
    return ServerSpec(name="prefill", role="prefill", model_dir=tmp_path, **kwargs)


def test_push_mode_runs_vllms_push_connector(tmp_path):
    assert _spec(tmp_path, transfer_mode="push").kv_transfer_config(tmp_path)["kv_connector"] == "NixlPushConnector"
    assert _spec(tmp_path).kv_transfer_config(tmp_path)["kv_connector"] == "NixlConnector"
    assert _spec(tmp_path, connector="leasekit").kv_transfer_config(tmp_path)["kv_connector"] == "LeaseKitConnector"


def test_leasekit_push_mode_runs_leasekits_push_connector_from_the_same_module(tmp_path):
    config = _spec(tmp_path, connector="leasekit", transfer_mode="push").kv_transfer_config(tmp_path)
    assert config["kv_connector"] == "LeaseKitPushConnector"
    assert config["kv_connector_module_path"] == "leasekit.vllm.connector"
    with pytest.raises(ValueError, match=r"transfer_mode must be one of \('pull', 'push'\), got 'write'"):
        _spec(tmp_path, transfer_mode="write")


def test_a_pair_spec_in_push_mode_starts_both_servers_in_push_mode(tmp_path):
    spec = PairSpec(prefill_connector="stock", decode_connector="stock", transfer_mode="push", lease_duration_s=6)
    pair = PDPair.planned(spec, tmp_path / "run")
    for server in (pair.prefill, pair.decode):
        command = server.command()
        config = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == "NixlPushConnector"
    stock = dict(prefill_connector="stock", decode_connector="stock")
    assert PairSpec(transfer_mode="push", **stock).launch_key() != PairSpec(**stock).launch_key()  # a fresh pair per mode
    mixed = PDPair.planned(PairSpec(transfer_mode="push", decode_connector="stock", lease_duration_s=6), tmp_path / "m")
    names = [json.loads(s.command()[s.command().index("--kv-transfer-config") + 1])["kv_connector"]
             for s in (mixed.prefill, mixed.decode)]
    assert names == ["LeaseKitPushConnector", "NixlPushConnector"]  # interop: LeaseKit P, stock D
    with pytest.raises(ValueError, match="transfer_mode must be 'pull' or 'push', got 'PUSH'"):
        PairSpec(transfer_mode="PUSH", **stock)


def test_router_sends_p_and_d_one_request_id_and_a_new_one_per_request():
    seen: list[tuple[str, str | None]] = []

    def server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, request.headers.get("x-request-id")))
        if request.url.host == "p":
            return httpx.Response(200, json={"kv_transfer_params": {"remote_request_id": "cmpl-x-0-1234abcd"}})
        return httpx.Response(200, json={"choices": [{"token_ids": [1] * body["max_tokens"]}]})

    router = Router("http://p", "http://d")
    router._client = httpx.Client(transport=httpx.MockTransport(server))
    first, second = router.generate([1, 2, 3], 2), router.generate([1, 2, 3], 2)
    assert first.decode.ok and second.decode.ok
    (p1, id1), (d1, id2), (p2, id3), (d2, id4) = seen
    assert (p1, d1, p2, d2) == ("p", "d", "p", "d")
    assert id1 == id2 == first.prefill.routing_id and id3 == id4 == second.prefill.routing_id
    assert id1 != id3
    assert len(new_routing_id()) == 32 and int(new_routing_id(), 16) >= 0


def test_a_push_scenario_runs_on_both_targets_in_push_mode():
    from leasekit.chaos.scenario import find_scenario
    from leasekit.chaos.pool import pair_spec

    push = find_scenario("kill-decode-push")
    assert push.topology.transfer_mode == "push" and sorted(push.topology.targets) == ["leasekit", "stock"]
    for target in ("leasekit", "stock"):
        spec = pair_spec(push, target)
        assert spec.transfer_mode == "push" and spec.prefill_connector == spec.decode_connector == target
    assert pair_spec(find_scenario("kill-decode"), "stock").transfer_mode == "pull"


def test_chaos_list_and_results_name_the_mode(capsys):
    from leasekit.chaos.result import ScenarioResult
    from leasekit.cli import main

    assert main(["chaos", "list", "-o", "json"]) == 0
    modes = {row["name"]: row["mode"] for row in json.loads(capsys.readouterr().out)}
    assert modes["kill-decode-push"] == "push" and modes["kill-decode"] == "pull"
    assert ScenarioResult("kill-decode-push", "stock", "PASS", "PASS", "", mode="push").to_json()["mode"] == "push"


def test_push_scenarios_refuse_fail_closed_and_external_pairs_refuse_push():
    from leasekit.chaos.scenario import ScenarioError, find_scenario
    from leasekit.cluster.external import ExternalPair

    push = find_scenario("kill-decode-push")
    data = push.model_dump()
    data["expect"]["checks"] = ["bounded_reclaim", "fail_closed"]
    with pytest.raises((ScenarioError, ValueError), match="expect.checks: fail_closed cannot be judged in push mode"):
        type(push).model_validate(data)
    external = ExternalPair("http://127.0.0.1:1", "http://127.0.0.1:2", "/nonexistent", target="stock", lease_duration_s=6)
    spec = PairSpec(prefill_connector="stock", decode_connector="stock", transfer_mode="push", lease_duration_s=6)
    assert "push mode" in external.matches(spec)


def test_router_never_reuses_an_idle_connection():
    """vLLM closes idle connections after 5 s, as long as httpx keeps them: a reused one can be lost
    unread, so every routed request opens its own connection (here: two decodes, two connections)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    connections: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive unless the client closes

        def setup(self) -> None:
            connections.append(1)
            super().setup()

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = json.dumps({"choices": [{"token_ids": [1] * body["max_tokens"]}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    router = Router(url, url, timeout_s=10.0)
    try:
        results = [router.decode([1, 2], None, 2) for _ in range(2)]
    finally:
        router.close()
        server.shutdown()
        server.server_close()
    assert [r.status for r in results] == [200, 200] and results[0].token_ids == [1, 1]
    assert len(connections) == 2
