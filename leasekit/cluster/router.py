"""The P -> D router: prefill on P with ``do_remote_decode`` and ``max_tokens=1``, then decode on D
with the ``kv_transfer_params`` P returned (the protocol of vLLM's
``examples/online_serving/disaggregated_serving`` proxies). Prompts are token-id lists because the
servers run with ``--skip-tokenizer-init``.

Like vLLM's proxies, the router sends one ``X-Request-Id`` (a fresh random id per routed request) to
both P and D: vLLM builds each side's internal request id from it (``cmpl-<X-Request-Id>-0-<8 hex>``),
and push mode (``NixlPushConnector``) needs that: P matches D's ``PUSH_REG`` registration to its
finished prefill by that id with the random suffix stripped (vllm ``nixl/push_worker.py``:
``_pop_matching_registration``, ``nixl/utils.py``: ``get_base_request_id``); without a shared id the
WRITE never starts and D waits until the client gives up. Pull mode does not need it; there it only
makes P's and D's request ids share the prefix ``cmpl-<X-Request-Id>-0-``.

Like a proxy instrumented with OpenTelemetry, the router starts one W3C trace per routed request and
sends its ``traceparent`` to both P and D, so vLLM's request spans and LeaseKit's lease spans on both
sides share one trace id (W3C Trace Context; vLLM reads it in ``serving.py: _get_trace_headers``).
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from leasekit.cluster.serverspec import SERVED_MODEL_NAME


@dataclass
class PrefillResult:
    """P's answer. ``request_id`` is P's internal id (``remote_request_id``), the lease key."""

    status: int
    latency_s: float
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    traceparent: str | None = None
    routing_id: str | None = None  # the X-Request-Id sent to P, to send to D with the decode

    @property
    def request_id(self) -> str | None:
        """P's request id, as it appears in P's lease spans (``gen_ai.request.id``)."""
        return (self.kv_transfer_params or {}).get("remote_request_id")

    @property
    def ok(self) -> bool:
        """HTTP 200 with kv_transfer_params to hand to D."""
        return self.status == 200 and bool(self.kv_transfer_params)


@dataclass
class DecodeResult:
    """D's answer: HTTP status (0 = no HTTP answer), generated token ids, error text."""

    status: int
    latency_s: float
    token_ids: list[int] | None = None
    error: str | None = None
    finish_reason: str | None = None
    created: int | None = None  # D's wall clock (epoch seconds) when it created the response
    done_monotonic_s: float = field(default_factory=time.monotonic)
    done_wall_s: float = field(default_factory=time.time)

    @property
    def ok(self) -> bool:
        """HTTP 200 with tokens."""
        return self.status == 200 and self.token_ids is not None


@dataclass
class RoutedResult:
    """One request routed P then D."""

    prefill: PrefillResult
    decode: DecodeResult | None = None
    submitted_monotonic_s: float = field(default_factory=time.monotonic)


class Router:
    """Routes requests P -> D over HTTP; thread-safe (one shared ``httpx.Client``, a new connection
    per request).

    Args:
        prefill_url / decode_url: server base URLs.
        timeout_s: per-request HTTP timeout in seconds.
    """

    def __init__(self, prefill_url: str, decode_url: str, timeout_s: float = 300.0):
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        # one connection per request, never an idle one reused: vLLM's API server closes a connection
        # idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s, vllm/envs.py), httpx keeps one for 5 s, and a
        # request sent on a connection the server is closing at that moment is lost unread
        # ("Server disconnected without sending a response"): D never sees that decode
        self._client = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=256, max_keepalive_connections=0))

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()

    def _post(self, url: str, body: dict[str, Any], timeout_s: float | None = None,
              traceparent: str | None = None, routing_id: str | None = None,
              ) -> tuple[int, dict[str, Any] | None, str | None, float]:
        t0 = time.monotonic()
        try:
            extra: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
            headers = {name: value for name, value in (("traceparent", traceparent), ("X-Request-Id", routing_id)) if value}
            if headers:
                extra["headers"] = headers
            response = self._client.post(f"{url}/v1/completions", json=body, **extra)
        except httpx.HTTPError as exc:
            return 0, None, f"{type(exc).__name__}: {exc}", time.monotonic() - t0
        latency = time.monotonic() - t0
        try:
            payload = response.json()
        except ValueError:
            payload = None
        if response.status_code != 200:
            return response.status_code, payload, response.text[:500], latency
        return 200, payload, None, latency

    def prefill(self, prompt: list[int]) -> PrefillResult:
        """Prefill ``prompt`` (token ids) on P with ``do_remote_decode``; P then holds a lease.

        Starts a new trace and a new routing id: the result's ``traceparent`` and ``routing_id`` go to D
        with :meth:`decode`."""
        traceparent, routing_id = new_traceparent(), new_routing_id()
        status, payload, error, latency = self._post(
            self.prefill_url,
            {
                "model": SERVED_MODEL_NAME,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0.0,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
            },
            traceparent=traceparent,
            routing_id=routing_id,
        )
        params = (payload or {}).get("kv_transfer_params") if status == 200 else None
        if status == 200 and not params:
            error = "P answered 200 without kv_transfer_params (is P a kv_producer with a NIXL connector?)"
        return PrefillResult(status=status, latency_s=latency, kv_transfer_params=params, error=error,
                             traceparent=traceparent, routing_id=routing_id)

    def decode(self, prompt: list[int], kv_transfer_params: dict[str, Any] | None, max_tokens: int,
               *, timeout_s: float | None = None, traceparent: str | None = None,
               routing_id: str | None = None) -> DecodeResult:
        """Decode ``max_tokens`` tokens on D, with the prompt's KV blocks from P (D reads them in pull
        mode; P writes them into D in push mode).

        ``timeout_s``: give up (disconnect; vLLM then aborts the request) after this many seconds.
        ``traceparent``: the W3C trace context to send (the prefill's, to join one trace).
        ``routing_id``: the prefill's ``X-Request-Id`` (:attr:`PrefillResult.routing_id`); push mode needs
        it, or P never matches D's registration.
        """
        body: dict[str, Any] = {
            "model": SERVED_MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        status, payload, error, latency = self._post(self.decode_url, body, timeout_s, traceparent, routing_id)
        if status != 200 or payload is None:
            return DecodeResult(status=status, latency_s=latency, error=error)
        choice = (payload.get("choices") or [{}])[0]
        return DecodeResult(
            status=200,
            latency_s=latency,
            token_ids=choice.get("token_ids"),
            finish_reason=choice.get("finish_reason"),
            created=payload.get("created"),
        )

    def generate(self, prompt: list[int], max_tokens: int) -> RoutedResult:
        """Prefill on P, then decode on D (skipped if P failed)."""
        result = RoutedResult(prefill=self.prefill(prompt))
        if result.prefill.ok:
            result.decode = self.decode(prompt, result.prefill.kv_transfer_params, max_tokens,
                                        traceparent=result.prefill.traceparent, routing_id=result.prefill.routing_id)
        return result

    def hold_decode_slot(self, prompt: list[int], stop: threading.Event, max_tokens: int = 4000) -> int:
        """Stream a long local generation on D until ``stop`` is set, then disconnect (vLLM aborts it).

        With ``--max-num-seqs 1`` this occupies D's only running slot, so P->D requests wait in D's
        queue (where D heartbeats them). Returns the number of stream chunks received.
        """
        body = {
            "model": SERVED_MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        chunks = 0
        try:
            with self._client.stream("POST", f"{self.decode_url}/v1/completions", json=body) as response:
                for _ in response.iter_lines():
                    chunks += 1
                    if stop.is_set():
                        break
        except httpx.HTTPError:
            pass
        return chunks


def new_routing_id() -> str:
    """A fresh ``X-Request-Id`` for one routed request: 32 lowercase hex digits (a random UUID's)."""
    return uuid.uuid4().hex


def new_traceparent() -> str:
    """A fresh sampled W3C ``traceparent`` (``00-<32 hex trace id>-<16 hex span id>-01``)."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
