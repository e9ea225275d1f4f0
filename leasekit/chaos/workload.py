"""The generator: P->D requests held in D's queue, an overload queue, or an abort storm.

D runs with one running slot (``--max-num-seqs 1``). For ``queued`` and ``abort_storm`` a streamed
local generation holds that slot, so routed requests wait in D's scheduler queue, where D tracks
them from ``on_new_request`` and heartbeats their leases on P (vllm 0.32.0 ``base_scheduler.py``).
For ``overload`` the routed requests themselves keep D busy. Readiness is read from D's real
``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` gauges, not assumed from sleeps.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from leasekit.cluster.pair import PDPair
from leasekit.cluster.router import DecodeResult, PrefillResult


class WorkloadError(RuntimeError):
    """The workload could not reach its starting state (slot not held, requests not queued)."""


@dataclass
class QueuedDecodeLoad:
    """Route ``requests`` requests to D, queued behind a held slot (``queued``/``abort_storm``) or
    behind each other (``overload``).

    Filled as it runs (times ``time.monotonic()`` seconds of this process): ``prefills`` and
    ``prompts`` (token ids; one per request, in order), ``decodes`` (index -> result), ``queued_at``, ``intent`` (index ->
    ``decode`` | ``cancel`` | ``never``: what the workload meant to happen to each request).
    """

    pair: PDPair
    requests: int
    prompt_tokens: int = 48
    decode_tokens: int = 4
    kind: str = "queued"
    cancel_queued_fraction: float = 0.0
    never_decode_fraction: float = 0.0
    cancel_after_s: float = 3.0
    prefills: list[PrefillResult] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    decodes: dict[int, DecodeResult] = field(default_factory=dict)
    intent: dict[int, str] = field(default_factory=dict)
    queued_at: float | None = None
    slot_held_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _gauge(self, name: str) -> float | None:
        try:
            return self.pair.decode.metrics().get(name)
        except httpx.HTTPError:
            return None

    def _wait_gauge(self, name: str, at_least: float, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self._gauge(name)
            if value is not None and value >= at_least:
                return True
            time.sleep(0.1)
        return False

    def _plan(self) -> None:
        # cancels are routed last, so their clients give up (``cancel_after_s`` after routing) only
        # once every request sits in D's queue
        never = round(self.requests * self.never_decode_fraction)
        cancel = round(self.requests * self.cancel_queued_fraction)
        for index in range(self.requests):
            self.intent[index] = "never" if index < never else "cancel" if index >= self.requests - cancel else "decode"

    def start(self, timeout_s: float = 60.0) -> None:
        """Reach the queued state; returns once D reports the routed requests waiting.

        Raises:
            WorkloadError: the slot was not taken, a prefill failed, or the requests never queued.
        """
        router = self.pair.router
        assert router is not None, "pair not started"
        self._plan()
        if self.kind != "overload":
            holder = threading.Thread(target=router.hold_decode_slot, args=(self.pair.prompt(16), self._stop),
                                      name="hold-decode-slot", daemon=True)
            holder.start()
            self._threads.append(holder)
            if not self._wait_gauge("vllm:num_requests_running", 1, timeout_s):
                raise WorkloadError(f"D never reported a running request within {timeout_s:.0f} s (slot not held)")
            self.slot_held_at = time.monotonic()
        for index in range(self.requests):
            prompt = self.pair.prompt(self.prompt_tokens)
            prefill = router.prefill(prompt)
            self.prefills.append(prefill)
            self.prompts.append(prompt)
            if not prefill.ok:
                raise WorkloadError(f"prefill {index} failed on P: HTTP {prefill.status} {prefill.error}")
            if self.intent[index] == "never":
                continue
            timeout = self.cancel_after_s if self.intent[index] == "cancel" else None
            thread = threading.Thread(target=self._decode, args=(index, prompt, prefill, timeout), name=f"decode-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)
        decoding = sum(1 for i in self.intent.values() if i != "never")
        waiting = decoding - 1 if self.kind == "overload" else decoding
        if waiting > 0 and not self._wait_gauge("vllm:num_requests_waiting", waiting, timeout_s):
            raise WorkloadError(
                f"D never reported {waiting} waiting requests within {timeout_s:.0f} s "
                f"(waiting={self._gauge('vllm:num_requests_waiting')})"
            )
        self.queued_at = time.monotonic()

    def _decode(self, index: int, prompt: list[int], prefill: PrefillResult, timeout_s: float | None) -> None:
        assert self.pair.router is not None
        result = self.pair.router.decode(prompt, prefill.kv_transfer_params, self.decode_tokens, timeout_s=timeout_s,
                                         traceparent=prefill.traceparent)
        with self._lock:
            self.decodes[index] = result

    def release_slot(self) -> None:
        """Stop the long generation (client disconnect; vLLM aborts it) so D serves the queue."""
        self._stop.set()

    def wait_decodes(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for every routed decode to return (any outcome)."""
        expected = sum(1 for i in self.intent.values() if i != "never")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.decodes) >= expected:
                    return True
            time.sleep(0.1)
        return False

    @property
    def request_ids(self) -> list[str]:
        """P's request ids (the lease keys) of the routed requests, in order."""
        return [p.request_id for p in self.prefills if p.request_id]

    def request_id(self, index: int) -> str | None:
        """P's request id of request ``index``."""
        return self.prefills[index].request_id if index < len(self.prefills) else None


class PrefillTraffic:
    """Prefill-only requests on P at ``rps`` per second in a background thread (P stays busy)."""

    def __init__(self, pair: PDPair, rps: float):
        self.pair, self.rps = pair, rps
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0

    def start(self) -> None:
        """Start sending (no-op when ``rps`` is 0)."""
        if self.rps <= 0:
            return
        self._thread = threading.Thread(target=self._run, name="prefill-traffic", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0 / self.rps):
            if self.pair.router is not None:
                self.pair.router.prefill(self.pair.prompt(32))
                self.sent += 1

    def stop(self) -> None:
        """Stop sending and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
