"""The generator: P->D requests held in D's queue, an overload queue, or an abort storm.

D runs with ``S`` running slots (``--max-num-seqs S``: 1 on the CPU pair, up to 256 on a GPU D).
Long local generations fill the slots first, so the routed requests wait in D's scheduler queue,
where D tracks them from ``on_new_request`` and heartbeats their leases on P (vllm 0.32.0
``base_scheduler.py``): for ``queued`` and ``abort_storm`` all ``S`` slots are held until the
executor releases them; for ``overload`` ``S - 1`` are held, so the routed requests queue behind
each other on D's one free slot, as on a one-slot D. The slots are held by one streamed completion
with ``n = S`` samples: vLLM fans ``n`` out into ``n`` scheduler requests, each taking a running
slot (``vllm/v1/engine/async_llm.py``, ``ParentRequest``), over one HTTP connection whatever ``S``.
Readiness is read from D's real ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``
gauges, not assumed from sleeps.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field

import httpx

from leasekit.chaos.actions import Effect
from leasekit.cluster.pair import PDPair
from leasekit.cluster.router import DecodeResult, PrefillResult
from leasekit.cluster.serverspec import SERVED_MODEL_NAME

HOLDER_MAX_TOKENS = 4000
"""Tokens each slot-holding sample may generate when D's ``max_model_len`` cannot be read (with a
16-token prompt, within ``--max-model-len 4096``), and the least :func:`holder_tokens` gives when
D allows it. A sample that generates them all before it is released frees its slot early:
:attr:`SlotHolder.ran_out` says so."""

HOLDER_TOKEN_BUDGET = 16_000
"""Tokens all slot-holding samples together may reach above ``HOLDER_MAX_TOKENS`` each (one sample on
the CPU pair's D, whose KV cache holds 65 536 tokens and whose ``max_model_len`` is 16 384): at
L = 30 a D that is not slowed down decodes 4000 tokens before the run releases its slot."""


def holder_tokens(decode_url: str, slots: int, prompt_tokens: int, *, timeout_s: float = 5.0) -> int:
    """``max_tokens`` for each of ``slots`` slot-holding samples whose prompt is ``prompt_tokens``
    long: ``max(HOLDER_MAX_TOKENS, HOLDER_TOKEN_BUDGET // slots)``, within D's ``max_model_len``
    (read from D's OpenAI-compatible ``GET /v1/models``, vLLM ``serving_models.py``); at least 1.
    If D does not say, ``HOLDER_MAX_TOKENS``. Never raises."""
    try:
        models = httpx.get(f"{decode_url}/v1/models", timeout=timeout_s).json()["data"]
        limit = int(models[0]["max_model_len"]) - prompt_tokens - 1
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return HOLDER_MAX_TOKENS
    return max(1, min(limit, max(HOLDER_MAX_TOKENS, HOLDER_TOKEN_BUDGET // max(1, slots))))


class WorkloadError(RuntimeError):
    """The workload could not reach its starting state (slots not held, requests not queued)."""


STEP_PROBE_TOKENS = 17
"""Tokens of the streamed completion that measures D's decode step (16 steps between its first
and last token)."""


def measure_decode_step_s(decode_url: str, prompt: list[int], tokens: int = STEP_PROBE_TOKENS,
                          timeout_s: float = 60.0) -> float:
    """D's decode step time, seconds per token: one streamed completion of ``tokens`` tokens
    (greedy, ``ignore_eos``) sent straight to D (no KV transfer), timed from its first token to its
    last over ``tokens - 1`` steps, so the prefill and the HTTP set-up do not count. Measured while
    D runs whatever else it runs (the slot holders of an overload), which is the step the queue sees.

    Raises:
        WorkloadError: D answered with an error, or streamed fewer than 2 tokens.
    """
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    arrivals = []
    try:
        with httpx.Client(timeout=httpx.Timeout(10.0, read=timeout_s)) as client:
            with client.stream("POST", f"{decode_url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise WorkloadError(f"D refused the decode-step probe: HTTP {response.status_code} "
                                        f"{response.read().decode(errors='replace')[:200]}")
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        arrivals.append(time.monotonic())
    except httpx.HTTPError as exc:
        raise WorkloadError(f"the decode-step probe to D failed: {type(exc).__name__}: {exc}") from exc
    if len(arrivals) < 2:
        raise WorkloadError(f"the decode-step probe streamed {len(arrivals)} token(s) from D, need at least 2")
    return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)


def overload_tokens(queue_wait_s: float, requests: int, step_s: float, most: int, least: int = 8) -> int:
    """Decode tokens per request so that ``requests`` requests served one after another on one slot
    keep the last one waiting about ``queue_wait_s`` seconds: ``ceil(queue_wait_s / (requests *
    step_s))``, kept within ``[least, most]``.

    Raises:
        ValueError: a time or count is not positive, or ``least > most``.
    """
    if queue_wait_s <= 0 or step_s <= 0 or requests < 1 or least < 1 or least > most:
        raise ValueError(f"queue_wait_s ({queue_wait_s}) and step_s ({step_s}) must be > 0, requests ({requests}) >= 1, "
                         f"1 <= least ({least}) <= most ({most})")
    return max(least, min(most, math.ceil(queue_wait_s / (requests * step_s))))


def queue_forming_tokens(tokens: int, requests: int, prefill_s: float, step_s: float, most: int,
                         margin: float = 1.5) -> int:
    """Decode tokens per request so that, with prefills routed one after another (``prefill_s`` seconds
    each, measured on the first) and D serving one request at a time (``step_s`` seconds per token), the
    first decode outlasts the ``requests - 1`` prefills after it by ``margin``: every routed request then
    sits in D's queue at once, however slow P is. At least ``tokens``, at most ``most``.

    Raises:
        ValueError: ``step_s`` not positive, or ``most`` < 1."""
    if not step_s > 0 or most < 1:
        raise ValueError(f"step_s ({step_s}) must be > 0 s and most ({most}) >= 1")
    needed = math.ceil(margin * max(0, requests - 1) * max(0.0, prefill_s) / step_s)
    return min(most, max(tokens, needed))


@dataclass
class SlotHolder:
    """Holds ``slots`` of D's running slots with one streamed completion of ``n = slots`` samples
    (``ignore_eos``, ``max_tokens`` each; sampled at temperature 1, as vLLM refuses ``n > 1`` with
    greedy sampling) until ``stop`` is set, then disconnects (vLLM aborts every sample).

    Filled as it runs: ``status`` (D's HTTP status), ``error``, ``finished`` (indices of the samples
    that generated all their tokens), ``ended_at`` (``time.monotonic()`` seconds when the stream ended).
    """

    decode_url: str
    slots: int
    prompt: list[int]
    stop: threading.Event
    max_tokens: int = HOLDER_MAX_TOKENS
    status: int | None = None
    error: str | None = None
    finished: set[int] = field(default_factory=set)
    ended_at: float | None = None
    stopped: bool = False

    def run(self) -> None:
        """Stream until ``stop`` (run it in a thread); never raises."""
        body = {"model": SERVED_MODEL_NAME, "prompt": self.prompt, "max_tokens": self.max_tokens, "n": self.slots,
                "temperature": 1.0, "ignore_eos": True, "stream": True}
        try:
            with httpx.Client(timeout=httpx.Timeout(10.0, read=None)) as client:
                with client.stream("POST", f"{self.decode_url}/v1/completions", json=body) as response:
                    self.status = response.status_code
                    if response.status_code != 200:
                        self.error = response.read().decode(errors="replace")[:300]
                        return
                    for line in response.iter_lines():
                        if self.stop.is_set():
                            self.stopped = True
                            break
                        self._count_finished(line)
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended_at = time.monotonic()

    def _count_finished(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        try:
            chunk = json.loads(line[len("data: "):])
        except ValueError:
            return
        self.finished.update(choice.get("index", 0) for choice in chunk.get("choices") or [] if choice.get("finish_reason"))

    @property
    def ran_out(self) -> bool:
        """Every sample generated all its tokens before ``stop``: D's slots freed themselves early."""
        return not self.stopped and len(self.finished) >= self.slots


@dataclass
class QueuedDecodeLoad:
    """Route ``requests`` requests to D, queued behind D's ``decode_slots`` held running slots
    (``queued``/``abort_storm``) or behind each other on D's one free slot (``overload``).

    ``decode_slots``: D's ``--max-num-seqs`` (1..256). ``cancel_after_s``: seconds after routing a
    cancelled request's client gives up (the cancelled requests are routed together, once every
    other routed request waits on D). ``answer_within_s``: seconds after routing every other request's client
    gives up (None: never). ``min_queue_wait_s``: for ``overload``, how long (seconds,
    the scenario's ``L``) some request must have waited for its answer for the overload to count.
    ``queue_wait_s``: for ``overload``, size the decodes (at most ``decode_tokens``) so the last
    request waits about this long (seconds), from D's step time measured at :meth:`start`
    (``decode_step_s``, seconds per token; ``decode_tokens`` then holds the size used).
    Filled as it runs (times ``time.monotonic()`` seconds of this process): ``prefills`` and ``prompts`` (token ids; one per request, in order), ``decodes``
    (index -> result), ``queued_at``, ``intent`` (index -> ``decode`` | ``cancel`` | ``never``: what
    the workload meant to happen to each request), ``holder`` (the slot holder, None if no slot is held).
    """

    pair: PDPair
    requests: int
    prompt_tokens: int = 48
    decode_tokens: int = 4
    kind: str = "queued"
    cancel_queued_fraction: float = 0.0
    never_decode_fraction: float = 0.0
    cancel_after_s: float = 3.0
    decode_slots: int = 1
    min_queue_wait_s: float | None = None
    queue_wait_s: float | None = None
    answer_within_s: float | None = None
    decode_step_s: float | None = None
    holder: SlotHolder | None = None
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
        # cancels are prefilled last and routed together once the rest wait on D (see :meth:`start`)
        never = round(self.requests * self.never_decode_fraction)
        cancel = round(self.requests * self.cancel_queued_fraction)
        for index in range(self.requests):
            self.intent[index] = "never" if index < never else "cancel" if index >= self.requests - cancel else "decode"

    @property
    def held_slots(self) -> int:
        """How many of D's running slots long generations hold: all of them, or all but one for
        ``overload`` (the routed requests then pass one at a time)."""
        return self.decode_slots - 1 if self.kind == "overload" else self.decode_slots

    def start(self, timeout_s: float = 60.0) -> None:
        """Reach the queued state; returns once D reports the routed requests waiting.

        Raises:
            WorkloadError: the slots were not taken, a prefill failed, or the requests never queued.
        """
        router = self.pair.router
        assert router is not None, "pair not started"
        if not 1 <= self.decode_slots <= 256:
            raise WorkloadError(f"decode_slots must be D's --max-num-seqs, 1..256, got {self.decode_slots}")
        self._plan()
        if self.held_slots > 0:
            prompt = self.pair.prompt(16)
            self.holder = SlotHolder(router.decode_url, self.held_slots, prompt, self._stop,
                                     max_tokens=holder_tokens(router.decode_url, self.held_slots, len(prompt)))
            thread = threading.Thread(target=self.holder.run, name="hold-decode-slots", daemon=True)
            thread.start()
            self._threads.append(thread)
            if not self._wait_gauge("vllm:num_requests_running", self.held_slots, timeout_s):
                raise WorkloadError(
                    f"D never reported {self.held_slots} running request(s) within {timeout_s:.0f} s (slots not held; "
                    f"running={self._gauge('vllm:num_requests_running')}, holder HTTP {self.holder.status} "
                    f"{self.holder.error or ''}); is D's --max-num-seqs topology.decode_max_num_seqs = {self.decode_slots}?")
            self.slot_held_at = time.monotonic()
        most = self.decode_tokens
        if self.kind == "overload" and self.queue_wait_s is not None:
            self.decode_step_s = measure_decode_step_s(router.decode_url, self.pair.prompt(16))
            self.decode_tokens = overload_tokens(self.queue_wait_s, self.requests, self.decode_step_s, most)
        for index in range(self.requests):
            prompt = self.pair.prompt(self.prompt_tokens)
            prefill = router.prefill(prompt)
            self.prefills.append(prefill)
            self.prompts.append(prompt)
            if not prefill.ok:
                raise WorkloadError(f"prefill {index} failed on P: HTTP {prefill.status} {prefill.error}")
            if index == 0 and self.decode_step_s:  # overload: the first decode outlasts every later prefill
                self.decode_tokens = queue_forming_tokens(self.decode_tokens, self.requests, prefill.latency_s,
                                                          self.decode_step_s, most)
            if self.intent[index] == "decode":
                self._route(index, prompt, prefill, self.answer_within_s)
        cancels = [i for i, x in self.intent.items() if x == "cancel"]
        decoding = sum(1 for i in self.intent.values() if i != "never")
        if cancels:
            # the cancelled clients give up ``cancel_after_s`` after routing: route them together, once
            # everything else waits on D, so that none gives up before the last one is queued (on a slow
            # host prefills take seconds each, and routing each right after its prefill let the first
            # ones give up before the queue was complete)
            self._wait_waiting(decoding - len(cancels) - (1 if self.kind == "overload" else 0), timeout_s)
            for index in cancels:
                self._route(index, self.prompts[index], self.prefills[index], self.cancel_after_s)
        self._wait_waiting(decoding - 1 if self.kind == "overload" else decoding, timeout_s)
        self.queued_at = time.monotonic()

    def _route(self, index: int, prompt: list[int], prefill: PrefillResult, timeout_s: float | None) -> None:
        thread = threading.Thread(target=self._decode, args=(index, prompt, prefill, timeout_s), name=f"decode-{index}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _wait_waiting(self, waiting: int, timeout_s: float) -> None:
        if waiting > 0 and not self._wait_gauge("vllm:num_requests_waiting", waiting, timeout_s):
            raise WorkloadError(
                f"D never reported {waiting} waiting requests within {timeout_s:.0f} s "
                f"(waiting={self._gauge('vllm:num_requests_waiting')}, running={self._gauge('vllm:num_requests_running')} "
                f"with {self.held_slots} held); does D run --max-num-seqs = topology.decode_max_num_seqs = {self.decode_slots}?"
                f" {self._answered()}"
            )

    def _answered(self) -> str:
        """The routed decodes that already answered (HTTP status and error): why one may be missing from D's queue."""
        with self._lock:
            done = {i: f"HTTP {d.status}{' ' + str(d.error)[:120] if d.error else ''}" for i, d in sorted(self.decodes.items())}
        return f"Decodes answered so far: {done or 'none'}; routed: {sum(1 for t in self._threads if t.name.startswith('decode-'))}."

    def _decode(self, index: int, prompt: list[int], prefill: PrefillResult, timeout_s: float | None) -> None:
        assert self.pair.router is not None
        result = self.pair.router.decode(prompt, prefill.kv_transfer_params, self.decode_tokens, timeout_s=timeout_s,
                                         traceparent=prefill.traceparent, routing_id=prefill.routing_id)
        with self._lock:
            self.decodes[index] = result

    def release_slot(self) -> None:
        """Stop the long generations (client disconnect; vLLM aborts them) so D serves the queue with
        all its slots. Idempotent."""
        self._stop.set()

    @property
    def slots_ran_out(self) -> bool:
        """The held slots freed themselves (every holding sample generated all its tokens) before
        :meth:`release_slot`: D served the queue earlier than the scenario meant."""
        return self.holder is not None and self.holder.ran_out

    def effects(self) -> list[Effect]:
        """Evidence that the workload did what the scenario meant (a PASS must not come from a queue
        that was never built): the requests meant to be cancelled while queued on D were (their
        clients gave up without an answer), an overload kept a request waiting longer than
        ``min_queue_wait_s`` (a fast D may serve the whole queue within L), and the generations holding D's running slots held them
        until the run released them (had they generated all their tokens first, D would have served
        its queue early, whatever the fault)."""
        effects = []
        cancelled = [i for i, x in self.intent.items() if x == "cancel"]
        if cancelled:
            answered = [i for i in cancelled if i in self.decodes and self.decodes[i].ok]
            gone = [i for i in cancelled if i in self.decodes and not self.decodes[i].ok]
            effects.append(Effect(f"{len(cancelled)} requests cancelled while queued on D", len(gone) == len(cancelled),
                                  f"{len(gone)} gave up without an answer, {len(answered)} were answered before the cancel"))
        answered = [d.latency_s for d in self.decodes.values() if d.ok]
        if self.kind == "overload" and self.min_queue_wait_s is not None and answered:
            sized = ("" if self.decode_step_s is None else
                     f" ({self.decode_tokens} tokens each, sized from D's step of {self.decode_step_s * 1000:.0f} ms)")
            effects.append(Effect(f"a request waited longer than {self.min_queue_wait_s:g} s on D", max(answered) > self.min_queue_wait_s,
                                  f"the slowest of {len(answered)} answers came {max(answered):.1f} s after its request was sent to D{sized}"))
        h = self.holder
        if h is not None:
            how = (f"all {h.slots} sample(s) generated their {h.max_tokens} tokens before the release" if h.ran_out
                   else f"it ended with {h.error}" if h.error else "held until the run released them")
            effects.append(Effect(f"D's {h.slots} running slot(s) held until released", not self.slots_ran_out,
                                  f"one streamed completion with n = {h.slots} held them: {how}"))
        return effects

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
