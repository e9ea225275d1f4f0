"""An overload sizes its decodes from D's measured decode step, so the last request waits about
``queue_wait_s`` whatever D's speed; the step is measured over real loopback HTTP from a stream."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leasekit.chaos.scenario import find_scenario
from leasekit.chaos.workload import WorkloadError, measure_decode_step_s, overload_tokens


class SteppingD(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` SSE chunks ``step_s`` apart after a slow first token (a prefill of
    ``first_s``), like vLLM's /v1/completions; ``status`` other than 200 refuses."""

    step_s = 0.02
    first_s = 0.3
    status = 200
    bodies: list = []

    def log_message(self, *args):  # noqa: D401 - quiet
        pass

    def do_POST(self):  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        SteppingD.bodies.append(body)
        self.send_response(self.status)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if self.status != 200:
            self.wfile.write(b'{"error": "no"}')
            return
        time.sleep(self.first_s)
        for step in range(body["max_tokens"]):
            if step:
                time.sleep(self.step_s)
            self.wfile.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def stepping_d():
    server = ThreadingHTTPServer(("127.0.0.1", 0), SteppingD)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    SteppingD.bodies, SteppingD.status = [], 200
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_step_is_timed_between_tokens_not_from_the_request(stepping_d):
    step = measure_decode_step_s(stepping_d, [1, 2, 3], tokens=11)
    assert 0.015 <= step < 0.1  # 20 ms steps; the 300 ms first token is not in it
    (body,) = SteppingD.bodies
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 11 and body["prompt"] == [1, 2, 3]
    assert "kv_transfer_params" not in body  # D computes it itself: no read from P


def test_a_refusing_d_is_a_workload_error(stepping_d):
    SteppingD.status = 503
    with pytest.raises(WorkloadError, match="HTTP 503"):
        measure_decode_step_s(stepping_d, [1])


def test_a_d_that_is_not_there_is_a_workload_error():
    with pytest.raises(WorkloadError, match="decode-step probe to D failed"):
        measure_decode_step_s("http://127.0.0.1:9", [1], timeout_s=2)


@given(wait=st.floats(0.5, 600), requests=st.integers(1, 256), step=st.floats(1e-4, 2.0), most=st.integers(8, 1024))
def test_tokens_keep_the_last_request_waiting_about_the_wait(wait, requests, step, most):
    tokens = overload_tokens(wait, requests, step, most)
    assert 8 <= tokens <= most
    if 8 < tokens < most:  # not clamped: the queue lasts the wait, within one request's step
        assert wait <= requests * tokens * step < wait + requests * step


def test_bad_sizing_input_names_the_values():
    with pytest.raises(ValueError, match=r"step_s \(0\)"):
        overload_tokens(12, 8, 0, 1000)
    with pytest.raises(ValueError, match=r"least \(8\) <= most \(4\)"):
        overload_tokens(12, 8, 0.1, 4)


def test_the_catalog_overload_waits_three_leases_at_any_lease():
    at_6 = find_scenario("overload-queue")
    at_30 = at_6.with_overrides(lease_duration_s=30)
    assert (at_6.workload.queue_wait_s, at_30.workload.queue_wait_s) == (18, 90)
    # a CPU D (80 ms steps) and a GPU D (15 ms steps) both keep the last request ~3L in the queue
    assert overload_tokens(90, 8, 0.08, at_30.workload.decode_tokens) == 141
    assert overload_tokens(90, 8, 0.015, at_30.workload.decode_tokens) == 750


@pytest.mark.parametrize("tokens,prefill_s,step_s,most,expect", [
    (45, 0.1, 0.05, 1000, 45),   # fast prefills: the queue-wait sizing already outlasts them
    (45, 0.5, 0.05, 1000, 105),  # slow P: 1.5 x 7 prefills of 0.5 s = 5.25 s of decode = 105 tokens
    (45, 5.0, 0.05, 1000, 1000),  # capped at the scenario's decode_tokens
])
def test_the_first_decode_outlasts_the_later_prefills(tokens, prefill_s, step_s, most, expect):
    from leasekit.chaos.workload import queue_forming_tokens

    got = queue_forming_tokens(tokens, 8, prefill_s, step_s, most)
    assert got == expect
    if got < most:
        assert got * step_s >= 1.5 * 7 * prefill_s - step_s  # D's first request ends after the 8th arrives
    with pytest.raises(ValueError, match="step_s"):
        queue_forming_tokens(tokens, 8, prefill_s, 0.0, most)
