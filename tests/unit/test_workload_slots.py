"""The slot holder speaks vLLM's streamed completions over real loopback HTTP; the workload holds
all of D's slots (queued, abort storm) or all but one (overload), and says when they ran out."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from leasekit.chaos.workload import QueuedDecodeLoad, SlotHolder
from leasekit.cluster.router import DecodeResult


class FakeD(BaseHTTPRequestHandler):
    """Streams SSE chunks like vLLM's /v1/completions: ``mode`` long (until the client goes),
    short (every sample finishes after 3 chunks), or refuse (HTTP 400)."""

    mode = "long"
    bodies: list = []

    def log_message(self, *args):  # noqa: D401 - quiet
        pass

    def do_POST(self):  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeD.bodies.append(body)
        if self.mode == "refuse":
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "n must be 1 when using greedy sampling"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for step in range(3 if self.mode == "short" else 500):
                for index in range(body["n"]):
                    last = self.mode == "short" and step == 2
                    chunk = {"choices": [{"index": index, "text": "x", "finish_reason": "length" if last else None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.01)
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture
def fake_d():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeD)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeD.bodies = []
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def hold(url, slots, stop_after_s=None):
    stop = threading.Event()
    holder = SlotHolder(url, slots, [1, 2, 3], stop)
    thread = threading.Thread(target=holder.run)
    thread.start()
    if stop_after_s is not None:
        time.sleep(stop_after_s)
        stop.set()
    thread.join(10)
    assert not thread.is_alive()
    return holder


def test_one_completion_with_n_samples_holds_the_slots_until_stopped(fake_d):
    _, url = fake_d
    holder = hold(url, 4, stop_after_s=0.3)
    body = FakeD.bodies[0]
    assert (body["n"], body["temperature"], body["ignore_eos"], body["stream"]) == (4, 1.0, True, True)
    assert holder.status == 200 and holder.stopped and not holder.ran_out and holder.finished == set()


def test_samples_that_finish_before_the_release_ran_out(fake_d):
    server, url = fake_d
    FakeD.mode = "short"
    try:
        holder = hold(url, 3)
    finally:
        FakeD.mode = "long"
    assert holder.finished == {0, 1, 2} and not holder.stopped and holder.ran_out


def test_a_refused_holder_keeps_ds_answer(fake_d):
    _, url = fake_d
    FakeD.mode = "refuse"
    try:
        holder = hold(url, 2)
    finally:
        FakeD.mode = "long"
    assert holder.status == 400 and "greedy" in holder.error and not holder.ran_out


def test_a_dead_d_is_an_error_not_a_run_out():
    holder = hold("http://127.0.0.1:9", 1)  # discard port: nothing listens
    assert holder.status is None and holder.error and not holder.ran_out


@pytest.mark.parametrize("kind, slots, held", [
    ("queued", 1, 1), ("queued", 4, 4), ("abort_storm", 256, 256), ("overload", 1, 0), ("overload", 4, 3),
])
def test_overload_leaves_one_slot_free_the_others_hold_them_all(kind, slots, held):
    assert QueuedDecodeLoad(pair=None, requests=8, kind=kind, decode_slots=slots).held_slots == held


def test_effects_report_cancels_and_slots_that_ran_out():
    load = QueuedDecodeLoad(pair=None, requests=3, kind="abort_storm", decode_slots=2)
    load.intent = {0: "decode", 1: "cancel", 2: "cancel"}
    load.decodes = {0: DecodeResult(200, 1.0, token_ids=[1]), 1: DecodeResult(0, 3.0, error="ReadTimeout"),
                    2: DecodeResult(200, 1.0, token_ids=[1])}
    load.holder = SlotHolder("http://d", 2, [1], threading.Event(), finished={0, 1})
    cancels, slots = load.effects()
    assert not cancels.took_effect and "1 gave up without an answer, 1 were answered" in cancels.evidence
    assert not slots.took_effect and "all 2 sample(s) generated their 4000 tokens before the release" in slots.evidence
    load.holder = SlotHolder("http://d", 2, [1], threading.Event(), stopped=True)
    assert load.effects()[1].took_effect and "held until the run released them" in load.effects()[1].evidence


def test_an_overload_that_never_outlasted_l_did_not_take_effect():
    load = QueuedDecodeLoad(pair=None, requests=2, kind="overload", min_queue_wait_s=6.0)
    load.intent = {0: "decode", 1: "decode"}
    load.decodes = {0: DecodeResult(200, 2.0, token_ids=[1]), 1: DecodeResult(200, 4.5, token_ids=[1])}
    (effect,) = load.effects()
    assert not effect.took_effect and "the slowest of 2 answers came 4.5 s" in effect.evidence
    load.decodes[1] = DecodeResult(200, 6.5, token_ids=[1])
    assert load.effects()[0].took_effect


def test_holder_tokens_follow_ds_max_model_len_and_fall_back_when_d_does_not_say():
    import json as _json
    import threading as _threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from leasekit.chaos.workload import HOLDER_MAX_TOKENS, HOLDER_TOKEN_BUDGET, holder_tokens

    answer = {"max_model_len": 16384}

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = _json.dumps({"data": [{"id": "leasekit-tiny", **answer}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    _threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert holder_tokens(url, 1, 16) == HOLDER_TOKEN_BUDGET  # 16 000 < 16384 - 17
        assert holder_tokens(url, 8, 16) == HOLDER_MAX_TOKENS  # the budget split 8 ways is below the floor
        answer["max_model_len"] = 4096
        assert holder_tokens(url, 1, 16) == 4096 - 17  # never past D's max_model_len
        answer.pop("max_model_len")
        assert holder_tokens(url, 1, 16) == HOLDER_MAX_TOKENS  # D does not say
    finally:
        server.shutdown()
    assert holder_tokens(url, 1, 16, timeout_s=0.5) == HOLDER_MAX_TOKENS  # D not there


class _StormRouter:
    """Stands in for the P -> D router of an abort storm: each prefill takes ``prefill_s`` (a slow
    host), each routed decode waits on D for ``serve_s`` or until its client gives up."""

    def __init__(self, prefill_s: float, serve_s: float):
        self.prefill_s, self.serve_s = prefill_s, serve_s
        self.waiting: set[int] = set()
        self.routed: list[tuple[int, float, float | None]] = []
        self.lock = threading.Lock()
        self.decode_url = "http://d"

    def prefill(self, prompt):
        from leasekit.cluster.router import PrefillResult
        time.sleep(self.prefill_s)
        return PrefillResult(200, self.prefill_s, {"remote_request_id": f"r{prompt[0]}"})

    def decode(self, prompt, params, tokens, timeout_s=None, traceparent=None, routing_id=None):
        index = prompt[0]
        with self.lock:
            self.routed.append((index, time.monotonic(), timeout_s))
            self.waiting.add(index)
        wait = self.serve_s if timeout_s is None else min(self.serve_s, timeout_s)
        time.sleep(wait)
        with self.lock:
            self.waiting.discard(index)
        if timeout_s is not None and timeout_s < self.serve_s:
            return DecodeResult(0, wait, error="ReadTimeout")
        return DecodeResult(200, wait, token_ids=[1])


class _StormPair:
    def __init__(self, router):
        self.router = router
        self.count = 0
        self.decode = self

    def prompt(self, tokens):
        self.count += 1
        return [self.count - 1]

    def metrics(self):
        with self.router.lock:
            return {"vllm:num_requests_waiting": float(len(self.router.waiting))}


def test_abort_storm_cancels_are_routed_together_once_the_rest_wait_on_d(monkeypatch):
    # prefills of 0.4 s each and cancels that give up 0.5 s after routing: routing each cancel right
    # after its prefill would let the first give up before the last is queued
    router = _StormRouter(prefill_s=0.4, serve_s=30.0)
    load = QueuedDecodeLoad(pair=_StormPair(router), requests=6, kind="abort_storm", decode_slots=1,
                            never_decode_fraction=0.34, cancel_queued_fraction=0.34, cancel_after_s=0.5)
    monkeypatch.setattr(QueuedDecodeLoad, "held_slots", property(lambda self: 0))  # no slot holder in the stand-in
    load.start(timeout_s=5.0)
    assert load.intent == {0: "never", 1: "never", 2: "decode", 3: "decode", 4: "cancel", 5: "cancel"}
    routed = {index: at for index, at, _ in router.routed}
    assert set(routed) == {2, 3, 4, 5}
    assert abs(routed[4] - routed[5]) < 0.2  # together, not a prefill apart
    assert min(routed[4], routed[5]) > routed[3] + 0.4  # after the last prefill, with the rest queued
    assert {i: t for i, _, t in router.routed} == {2: None, 3: None, 4: 0.5, 5: 0.5}
    assert load.queued_at is not None and load.queued_at < max(routed.values()) + 0.5  # all 4 seen waiting
    load.release_slot()
