"""The generator: P->D requests queued on D behind one long local generation.

D runs with one running slot (``--max-num-seqs 1``). A streamed local generation holds that slot, so
every routed request waits in D's scheduler queue, where D tracks it from ``on_new_request`` and
heartbeats its lease on P (vllm 0.32.0 ``base_scheduler.py``). Readiness is read from D's real
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
    """Hold D's running slot, then queue ``requests`` routed requests behind it.

    Attributes filled as it runs (all times ``time.monotonic()`` seconds of this process):
    ``prefills`` (one per request, in order), ``decodes`` (index -> result, as they finish),
    ``queued_at`` (when D reported every request waiting).
    """

    pair: PDPair
    requests: int
    prompt_tokens: int = 48
    decode_tokens: int = 4
    prefills: list[PrefillResult] = field(default_factory=list)
    decodes: dict[int, DecodeResult] = field(default_factory=dict)
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

    def start(self, timeout_s: float = 60.0) -> None:
        """Hold D's slot, route every request, return once D reports them all waiting.

        Raises:
            WorkloadError: the slot was not taken, a prefill failed, or the requests never queued.
        """
        router = self.pair.router
        assert router is not None, "pair not started"
        hold_prompt = self.pair.prompt(16)
        holder = threading.Thread(
            target=router.hold_decode_slot, args=(hold_prompt, self._stop), name="hold-decode-slot", daemon=True
        )
        holder.start()
        self._threads.append(holder)
        if not self._wait_gauge("vllm:num_requests_running", 1, timeout_s):
            raise WorkloadError(f"D never reported a running request within {timeout_s:.0f} s (slot not held)")
        self.slot_held_at = time.monotonic()
        for index in range(self.requests):
            prompt = self.pair.prompt(self.prompt_tokens)
            prefill = router.prefill(prompt)
            self.prefills.append(prefill)
            if not prefill.ok:
                raise WorkloadError(f"prefill {index} failed on P: HTTP {prefill.status} {prefill.error}")
            thread = threading.Thread(
                target=self._decode, args=(index, prompt, prefill), name=f"decode-{index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        if not self._wait_gauge("vllm:num_requests_waiting", self.requests, timeout_s):
            raise WorkloadError(
                f"D never reported {self.requests} waiting requests within {timeout_s:.0f} s "
                f"(waiting={self._gauge('vllm:num_requests_waiting')})"
            )
        self.queued_at = time.monotonic()

    def _decode(self, index: int, prompt: list[int], prefill: PrefillResult) -> None:
        assert self.pair.router is not None
        result = self.pair.router.decode(prompt, prefill.kv_transfer_params, self.decode_tokens)
        with self._lock:
            self.decodes[index] = result

    def release_slot(self) -> None:
        """Stop the long generation (client disconnect; vLLM aborts it) so D serves the queue."""
        self._stop.set()

    def wait_decodes(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for every routed request's decode to finish."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.decodes) >= len(self.prefills):
                    return True
            time.sleep(0.1)
        return False

    @property
    def request_ids(self) -> list[str]:
        """P's request ids (the lease keys) of the routed requests, in order."""
        return [p.request_id for p in self.prefills if p.request_id]
