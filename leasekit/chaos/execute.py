"""Run one scenario against one target on a running pair: steady state, fault run, evidence,
checks, verdict (PASS / FAIL / UNKNOWN with the bound, the measured value and the timeline)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from leasekit.chaos import FAIL, PASS, UNKNOWN
from leasekit.chaos.actions import Effect, FaultRun, not_injectable
from leasekit.chaos.checks import (CheckResult, check_all_served, check_bounded_reclaim, check_fail_closed, check_no_expiry,
                                   check_steady_state, on_time_only)
from leasekit.chaos.endchecks import (check_conservation, check_decode_conservation, check_no_late_write, late_writes_on,
                                      liveness_after)
from leasekit.chaos.evidence import ClockMismatch, Evidence, EvidenceReader
from leasekit.chaos.faults.onhost import host_of
from leasekit.chaos.launcheffects import launch_effects, wall_clock_effects
from leasekit.chaos.plot import plot_timeline
from leasekit.chaos.pusheffects import aborted_mid_push
from leasekit.chaos.result import ScenarioResult
from leasekit.chaos.scenario import Scenario
from leasekit.chaos.schema import PartitionFault
from leasekit.chaos.traffic import PrefillTraffic
from leasekit.chaos.workload import QueuedDecodeLoad
from leasekit.cluster.pair import PDPair
from leasekit.telemetry import semconv as sc


def target_connectors(target: str) -> dict[str, str]:
    """The connector each side runs for ``target``."""
    return {"prefill": target, "decode": target}


class ScenarioExecution:
    """Executes ``scenario`` for ``target`` on ``pair``; ``steady_cache`` shares steady-state
    results between scenarios with the same workload on the same pair."""

    def __init__(self, scenario: Scenario, target: str, pair: PDPair, out_dir: Path, *,
                 say=print, steady_cache: dict | None = None):
        self.s, self.target, self.pair, self.out_dir, self.say = scenario, target, pair, Path(out_dir), say
        self.timing = scenario.lease.timing()
        self.reader = EvidenceReader(pair, target, self.timing)
        self.steady_cache = steady_cache if steady_cache is not None else {}
        self.result = ScenarioResult(scenario.name, target, UNKNOWN, scenario.expect.verdict_for(target), "",
                                     incident=scenario.incident, mode=scenario.topology.transfer_mode,
                                     known_defect=getattr(scenario.expect, f"known_defect_{target}"),
                                     expected_failing=list(scenario.expect.failing_checks))
        self.fault_run: FaultRun | None = None
        self.load: QueuedDecodeLoad | None = None

    # -- phases ----------------------------------------------------------------------------
    def _load(self) -> QueuedDecodeLoad:
        w = self.s.workload
        cancel_after = self.s.cancel_after_s()
        load = QueuedDecodeLoad(self.pair, w.requests, w.prompt_tokens, w.decode_tokens, kind=w.kind,
                                cancel_queued_fraction=w.cancel_queued_fraction, never_decode_fraction=w.never_decode_fraction,
                                cancel_after_s=cancel_after, decode_slots=self.s.topology.decode_max_num_seqs,
                                min_queue_wait_s=float(self.timing.lease_duration_s), queue_wait_s=w.queue_wait_s,
                                answer_within_s=w.answer_within_s)
        self.load = load
        return load

    def steady_state(self) -> CheckResult | None:
        """Run the workload without the fault and check the steady-state hypothesis (None when the
        scenario disables it). Cached per D process and workload.

        Raises:
            leasekit.chaos.workload.WorkloadError: the workload could not be set up (harness error).
        """
        ss = self.s.steady_state
        if not ss.enabled:
            return None
        key = (self.target, str(getattr(self.pair, "run_dir", "")), getattr(self.pair.decode, "started_at", None),
               self.s.workload.model_dump_json(), self.s.hold_decode_slot_s(),
               ss.model_dump_json())  # this D process, this workload, this hypothesis
        if key in self.steady_cache:
            cached = self.steady_cache[key][1]
            first = cached.details.get("first_run")
            self.result.notes.append(f"steady state reused from {self.steady_cache[key][0]} on this pair"
                                     + (f" (run twice there: the first had {first['summary']})" if first else ""))
            return cached
        self.say(f"{self.s.name}/{self.target}: steady state (no fault)")
        check = self._steady_run()
        if on_time_only(check):
            # leases that expired on time with no fault: D's heartbeats did not reach P for E (an
            # overloaded host, another job's burst). Once more, so a passing burst is not a verdict;
            # a pair that cannot keep its leases fails both times.
            first = check.summary
            load = os.getloadavg()
            self.say(f"{self.s.name}/{self.target}: steady state failed ({first}; load average {load[0]:.1f}); once more")
            check = self._steady_run()
            check.details["first_run"] = {"summary": first, "load_average": [round(x, 2) for x in load]}
            self.result.notes.append(f"steady state run twice: the first had {first} with no fault, every one on time "
                                     f"(load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}); the second: {check.summary}")
        self.steady_cache[key] = (self.s.name, check)
        return check

    def _steady_run(self) -> CheckResult:
        ss = self.s.steady_state
        load = self._load()
        load.start()
        if load.kind != "overload":
            time.sleep(max(0.0, load.queued_at + self.s.hold_decode_slot_s() - time.monotonic()))
            load.release_slot()
        load.wait_decodes(self._decode_wait_s())
        load.release_slot()  # overload: D's other slots are held until its queue is served
        evidence = self.reader.wait_ended(load.request_ids, max(30.0, self._lease_wait_s()))
        return check_steady_state(evidence.leases, [load.request_id(i) for i, x in load.intent.items() if x == "decode"],
                                  {i: d for i, d in load.decodes.items() if load.intent[i] == "decode"},
                                  self.timing, expiries_allowed=ss.expiries, all_served=ss.all_served)

    def silence_effects(self, evidence: Evidence) -> list[Effect]:
        """Evidence on P's side that D really went quiet: for each interval the fault run expects
        silence in (a stall, dropped heartbeat batches), the gap between the heartbeats P handled
        around it (any lease of this run) must be at least the expected length. The gap ends at the
        first heartbeat after the interval's middle, or an expiry; when neither came, at the first
        release after the middle of a lease granted before the interval (kept without a heartbeat)."""
        run = self.fault_run
        if run is None or not run.silences:
            return []
        beats = sorted({t for lease in evidence.leases for t in lease.heartbeats_s})
        effects = []
        for start, end, start_wall, min_gap, label in run.silences:
            try:
                a = self.reader.to_p_clock(start, start_wall)
                b = a + (end - start)
            except ClockMismatch as exc:
                effects.append(Effect(f"P heard nothing during the {label}", False, str(exc)))
                continue
            mid = (a + b) / 2
            before = [t for t in beats if t <= mid]
            if not before:
                effects.append(Effect(f"P heard nothing during the {label}", False,
                                      "no heartbeat on P before the interval to measure the gap from"))
                continue
            after = [(t, "heartbeat") for t in beats if t > mid]
            # a lease that expired in the silence got no heartbeat after it: the silence ends there
            after += [(l.end_s, "expiry") for l in evidence.leases if l.outcome == sc.OUTCOME_EXPIRED and l.end_s > before[-1]]
            if not after:  # released with no heartbeat first (WRITEs a writer stall held): a release ends the gap
                after = [(l.end_s, "release") for l in evidence.leases
                         if l.outcome == sc.OUTCOME_RELEASED and l.grant_s <= a and l.end_s > mid]
            if not after:
                effects.append(Effect(f"P heard nothing during the {label}", False,
                                      "no heartbeat, expiry or release on P after the interval to measure the gap to"))
                continue
            until, what = min(after)
            gap = until - before[-1]
            need = min(min_gap, 0.9 * float(self.timing.extension_s)) if what == "expiry" else min_gap
            effects.append(Effect(f"P heard nothing during the {label}", gap >= need,
                                  f"P heard no heartbeat for {gap:.3f} s (until the next {what}; at least {need:.3f} s expected)"))
        return effects

    def fault_phase(self) -> None:
        """Run the workload again with the faults at their times; every fault is undone on exit.

        Raises:
            leasekit.chaos.workload.WorkloadError, leasekit.chaos.faults.FaultError: set-up or
                injection failed (harness error).
        """
        s, pair = self.s, self.pair
        self.say(f"{s.name}/{self.target}: fault run")
        after = [s.fault_after_s(f) for f in s.faults]
        self.fault_run = run = FaultRun(pair, list(s.faults), after, self.timing, say=self.say)
        traffic = PrefillTraffic(pair, s.workload.prefill_rps)
        load = self._load()
        self._late_writes_before = late_writes_on(pair.decode) if "no_late_write" in s.expect.checks else None
        early = any(isinstance(f, PartitionFault) and f.first_handshake for f in s.faults)
        try:
            run.inject_early()
            if early:
                self._first_contact(load)
            else:
                load.start()
                traffic.start()
                run.run(load.queued_at)
                hold = self.s.workload.hold_decode_slot_s
                if hold is not None and load.queued_at + hold < run.partitions_end():
                    self._release(load, run)  # D reads while a partition is still in force
                run.finish_partition()
                self._release(load, run)
                if not run.d_killed:
                    load.wait_decodes(self._decode_wait_s())
        finally:
            load.release_slot()  # never leave D's slots held for the next scenario
            traffic.stop()
            run.cleanup()

    def _first_contact(self, load: QueuedDecodeLoad) -> None:
        """Route requests while D cannot reach P's side channel; lift the partition; route one more."""
        router = self.pair.router
        assert router is not None
        started = time.monotonic()
        results = []
        for _ in range(self.s.workload.requests):
            prompt = self.pair.prompt(self.s.workload.prompt_tokens)
            load.prompts.append(prompt)
            results.append(router.generate(prompt, self.s.workload.decode_tokens))
        load.prefills = [r.prefill for r in results]
        load.decodes = {i: r.decode for i, r in enumerate(results) if r.decode is not None}
        load.intent = {i: "decode" for i in range(len(results))}
        load.queued_at = started
        self.fault_run.finish_partition()

    def _decode_wait_s(self) -> float:
        """How long to wait for the routed decodes to answer, seconds: ``max(120, 4 L)``, plus the
        workload's tokens at a floor of 5 tokens/s (an overload passes one request at a time; a
        2-core host busy starting spare engines decodes at 5-15 tokens/s). A wait, not a bound:
        ``all_served`` asks only that nothing is lost."""
        w = self.s.workload
        tokens = self.load.decode_tokens if self.load is not None else w.decode_tokens  # as sized at start
        return max(120.0, 4 * float(self.timing.lease_duration_s)) + w.requests * tokens / 5.0

    def _lease_wait_s(self) -> float:
        """Seconds every lease may take to end once D let go: the bound ``max(L, E) + tick``, + 20."""
        return max(float(self.timing.lease_duration_s), float(self.timing.extension_s)) + self.s.lease.tick_s + 20

    def _release(self, load: QueuedDecodeLoad, run: FaultRun) -> None:
        """Let D serve its queue: after ``hold_decode_slot_s`` if set; else once every fault is over
        plus the whole bound, so a lease the fault made expire is expired when D reads it."""
        if load.kind == "overload":
            return
        if self.s.workload.hold_decode_slot_s is not None:
            release_at = load.queued_at + self.s.workload.hold_decode_slot_s
        else:
            last = max([w[1] or w[0] for w in run.windows], default=load.queued_at)
            bound = max(float(self.timing.lease_duration_s), float(self.timing.extension_s)) + self.s.lease.tick_s
            release_at = last + (bound + 1.0 if "fail_closed" in self.s.expect.checks else 0.0)
        time.sleep(max(0.0, release_at - time.monotonic()))
        load.release_slot()

    # -- checks ----------------------------------------------------------------------------
    def _checks(self, evidence: Evidence) -> list[CheckResult]:
        load, run, s = self.load, self.fault_run, self.s
        assert load is not None and run is not None
        ids = load.request_ids
        decode_ids = [load.request_id(i) for i, intent in load.intent.items() if intent == "decode"]
        checks = []
        for name in s.expect.checks:
            if name == "bounded_reclaim":
                fault_at = None
                if run.silenced_at is not None:
                    try:
                        fault_at = self.reader.to_p_clock(*run.silenced_at)
                    except ClockMismatch as exc:
                        self.result.notes.append(str(exc))
                        checks.append(CheckResult("bounded-reclaim", UNKNOWN, str(exc)))
                        continue
                checks.append(check_bounded_reclaim(evidence.leases, ids, self.timing, s.lease.tick_s, fault_at_s=fault_at,
                                                    waited_s=self._lease_wait_s()))
            elif name == "no_expiry":
                checks.append(check_no_expiry(evidence.leases, decode_ids, self.timing))
            elif name == "all_served":
                checks.append(check_all_served(load.decodes, [i for i, x in load.intent.items() if x == "decode"]))
            elif name == "fail_closed":
                served = {}
                try:
                    for index, result in load.decodes.items():
                        if result.ok:
                            served[load.request_id(index)] = self.reader.to_p_clock(result.done_monotonic_s, result.done_wall_s)
                    checks.append(check_fail_closed(evidence.leases, served, evidence.late_reads, evidence.discarded_reads,
                                                    self._recompute_matches(evidence.discarded_reads)))
                except ClockMismatch as exc:
                    checks.append(CheckResult("fail-closed", UNKNOWN, str(exc)))
            elif name == "conservation":
                checks.append(check_conservation(self._kv_usage_settled(self.pair.prefill), evidence.open_ids,
                                                 waited_s=self._settle_s))
            elif name == "decode_conservation":
                usage = None if run.d_killed else self._kv_usage_settled(self.pair.decode)
                checks.append(check_decode_conservation(usage, waited_s=self._settle_s, decode_killed=run.d_killed))
            elif name == "liveness":
                checks.append(liveness_after(load, self.pair, decode_killed=run.d_killed))
            elif name == "no_late_write":
                checks.append(check_no_late_write(self._late_writes_before, late_writes_on(self.pair.decode),
                                                  decode_killed=run.d_killed))
        return checks

    _late_writes_before: float | None = None

    def _recompute_matches(self, discarded: dict[str, str]) -> dict[str, bool | None]:
        """For each served request whose read D discarded: do its tokens equal a fresh routed run of
        the same prompt (None when either run has no tokens)?"""
        load, router = self.load, self.pair.router
        matches: dict[str, bool | None] = {}
        if load is None or router is None:
            return matches
        for index, result in sorted(load.decodes.items()):
            rid = load.request_id(index)
            if rid not in discarded or not result.ok or index >= len(load.prompts):
                continue
            fresh = router.generate(load.prompts[index], load.decode_tokens).decode
            ok = bool(fresh and fresh.ok and fresh.token_ids and result.token_ids)
            matches[rid] = (fresh.token_ids == result.token_ids) if ok else None
        return matches

    _settle_s = 0.0

    def _kv_usage_settled(self, server) -> float | None:
        """``server``'s (P's or D's) KV-cache usage once leases could all have ended (polls up to ``L + E + 5`` s)."""
        deadline = time.monotonic() + float(self.timing.lease_duration_s) + float(self.timing.extension_s) + 5
        start = time.monotonic()
        value = None
        while time.monotonic() < deadline:
            try:
                value = server.metrics().get("vllm:kv_cache_usage_perc", value)
            except httpx.HTTPError:
                pass  # keep the last reading: one failed scrape does not erase a measured leak
            if value == 0:
                break
            time.sleep(0.5)
        self._settle_s = time.monotonic() - start
        return value

    # -- the whole thing -------------------------------------------------------------------
    def execute(self) -> ScenarioResult:
        """Run every phase and decide the verdict. A scenario-level failure is a verdict, not an
        exception.

        Raises:
            Exception: a harness error (servers, workload or fault set-up); the suite turns it into
                an UNKNOWN result whose summary starts with "harness error".
        """
        started = time.monotonic()
        r = self.result
        reasons = [why for f in self.s.faults if (why := not_injectable(f, target_connectors(self.target)))]
        if reasons:
            r.verdict, r.summary = UNKNOWN, "; ".join(reasons)
            return r
        r.notes.extend(f"server restarted after a start timeout: {why.splitlines()[0]}" for why in getattr(self.pair, "start_retries", []))
        try:
            r.effects.extend(launch_effects(self.s.launch, self.pair))
            r.steady_state = self.steady_state()
            if r.steady_state is not None and r.steady_state.verdict == FAIL:
                return self._decide()  # the hypothesis does not hold: the fault would prove nothing
            self.fault_phase()
            r.request_ids = self.load.request_ids if self.load else []
            evidence = self.reader.wait_ended(r.request_ids, self._lease_wait_s())
            if "fail_closed" in self.s.expect.checks and self.target == "leasekit" and self.load is not None:
                served = {self.load.request_id(i) for i, d in self.load.decodes.items() if d.ok}
                evidence = self.reader.settle_reads(evidence, r.request_ids, served)  # D's read records land
            r.evidence_source = evidence.source
            r.effects.extend(self.fault_run.effects if self.fault_run else [])
            r.effects.extend(wall_clock_effects(self.s.launch, self.load.decodes.values() if self.load else []))
            r.effects.extend(self.silence_effects(evidence))
            r.effects.extend(self.load.effects() if self.load else [])  # cancels done, slots held until released
            r.effects.extend(aborted_mid_push(self.s, self.load, evidence.leases, self.reader.to_p_clock))
            r.faults = self.fault_run.records if self.fault_run else []
            r.checks = self._checks(evidence)
            self._plot(evidence)
        finally:
            r.duration_s = time.monotonic() - started
            for server in (getattr(self.pair, "prefill", None), getattr(self.pair, "decode", None)):
                if host_of(server) is not None and not server.host.closed:  # on another host: its log comes here
                    server.fetch_log()  # None when there is none (no HostError)
        return self._decide()

    def _decide(self) -> ScenarioResult:
        self.result.verdict, self.result.summary = self._verdict()
        return self.result

    def _verdict(self) -> tuple[str, str]:
        r = self.result
        if r.steady_state is not None and r.steady_state.verdict == FAIL:
            return FAIL, f"steady-state hypothesis failed: {r.steady_state.summary}"
        failed = [c for c in r.checks if c.verdict == FAIL]
        if failed:
            return FAIL, "; ".join(f"{c.name}: {c.summary}" for c in failed)
        inert = [e for e in r.effects if not e.took_effect]
        if inert:
            return UNKNOWN, "fault did not take effect: " + "; ".join(f"{e.fault} ({e.evidence})" for e in inert)
        unknown = [c for c in r.checks if c.verdict == UNKNOWN]
        if unknown:
            return UNKNOWN, "; ".join(f"{c.name}: {c.summary}" for c in unknown)
        return PASS, "; ".join(f"{c.name}: {c.summary}" for c in r.checks)

    def _plot(self, evidence: Evidence) -> None:
        if self.fault_run is None or not evidence.leases:
            return
        windows = []
        for start, end, label in self.fault_run.windows:
            try:
                a = self.reader.to_p_clock(start, time.time() - (time.monotonic() - start))
                b = None if end is None else self.reader.to_p_clock(end, time.time() - (time.monotonic() - end))
            except ClockMismatch:
                continue
            windows.append((a, b if b is not None else a, label))
        bounds = {}
        for check in self.result.checks:
            for row in check.rows:
                if row.bound_s is not None:
                    bounds[row.request_id] = row.bound_s
        path = self.out_dir / f"{self.s.name}-{self.target}.png"
        try:
            plot_timeline(path, evidence.leases, title=f"{self.s.name} / {self.target}", fault_windows=windows,
                          bounds=bounds, clock_note=f"P's {'perf_counter' if evidence.clock == 'monotonic' else 'wall clock'} ({evidence.source})")
            self.result.plot = str(path)
        except Exception as exc:  # noqa: BLE001 - a plot must not change a verdict
            self.result.notes.append(f"plot failed: {exc}")
