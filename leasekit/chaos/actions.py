"""Executes a scenario's faults against a running pair, at their times, with guaranteed cleanup,
and says whether each fault took effect (a PASS must never come from a fault that did nothing).
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass, field

from leasekit.chaos.faults import FreezerStall, KillFault, SigstopStall
from leasekit.chaos.faults.onhost import FaultFile, HostFreezerStall, HostPartitionInjector, HostSigstopStall, host_of, remote_site
from leasekit.chaos.faults.partition import PartitionInjector, PartitionSite, cuts_heartbeats, partition_rules
from leasekit.chaos.schema import (CONNECTOR_STALLS, HeartbeatFault, KillFault as KillSpec, NoFault, PartitionFault,
                                   StallFault)
from leasekit.cluster import background
from leasekit.cluster.pair import PDPair
from leasekit.lease.config import LeaseTiming


WRITER_STALL_WAIT_S = 60.0
"""Seconds past its duration an armed push writer stall may take to start (P's next WRITE) and be reported."""


def not_injectable(fault, target_connectors: dict[str, str]) -> str | None:
    """Why ``fault`` cannot be injected on this target (None if it can)."""
    if isinstance(fault, StallFault) and fault.method in CONNECTOR_STALLS and target_connectors[fault.target] != "leasekit":
        what = "a forward-pass stall" if fault.method == "forward_pass" else "a push writer stall"
        return f"{what} needs LeaseKit's connector on {fault.target}; this target runs the stock connector"
    if isinstance(fault, HeartbeatFault) and target_connectors["decode"] != "leasekit":
        return "heartbeat faults live in LeaseKitConnector's send path on D; this target runs the stock connector"
    return None


def _quiet_during(fault):
    """The context a fault runs in: a stall of a server (freezer, SIGSTOP or forward pass) holds every
    background server still warming up (:func:`leasekit.cluster.background.paused_for_foreground`) for
    its duration, because the reclaim deadlines it causes fall inside it and P's step period is judged
    there (the bound's tick): on a loaded 2-core CI host, a stock P whose D was frozen, with later pairs
    warming beside it, reaped 0.9 s and 1.8 s after its deadline in two runs. Any other fault runs
    as is (a kill returns at once; a writer stall is only armed here). Returns a context manager."""
    if isinstance(fault, StallFault) and fault.method != "push_writer":
        return background.paused_for_foreground()
    return contextlib.nullcontext()


@dataclass
class Effect:
    """Whether one fault (or launch condition) demonstrably took effect, with the evidence."""

    fault: str
    took_effect: bool
    evidence: str

    def to_json(self) -> dict:
        return {"fault": self.fault, "took_effect": self.took_effect, "evidence": self.evidence}


@dataclass
class FaultRun:
    """Runs ``faults`` on ``pair`` relative to ``queued_at`` (``time.monotonic()`` seconds).

    After :meth:`run`: ``records`` (one dict per fault), ``windows`` ((start, end, label) in runner
    monotonic seconds; end None = until the end), ``effects``, and ``silenced_at``: when D first
    went silent (the instant the reclaim bound counts from), in runner monotonic and wall seconds.
    """

    pair: PDPair
    faults: list
    after_s: list[float]
    timing: LeaseTiming
    records: list[dict] = field(default_factory=list)
    windows: list[tuple[float, float | None, str]] = field(default_factory=list)
    effects: list[Effect] = field(default_factory=list)
    silenced_at: tuple[float, float] | None = None
    d_killed: bool = False
    say: object = None
    _cleanups: list = field(default_factory=list)
    _partitions: list = field(default_factory=list)
    _writer_stalls: list = field(default_factory=list)  # (latest end, FaultFile, seq, fault, record), armed
    silences: list[tuple[float, float, float, float, str]] = field(default_factory=list)
    """Intervals P should have received no heartbeat in: (start, end runner monotonic s, start wall
    s, shortest gap P must show in s, label); checked against P's evidence by the executor."""

    def _expect_silence(self, start: float, end: float, start_wall: float, min_gap_s: float, label: str) -> None:
        self.silences.append((start, end, start_wall, min_gap_s, label))

    def _progress(self, message: str) -> None:
        if callable(self.say):
            self.say(message)

    def run(self, queued_at: float) -> None:
        """Inject every fault at ``queued_at + after_s`` (``time.monotonic()`` seconds), in time
        order; kills and stalls block for their duration, partitions run on until
        :meth:`finish_partition`.

        Raises:
            leasekit.chaos.faults.FaultError: a fault could not be injected (undo with :meth:`cleanup`).
        """
        for fault, after in sorted(zip(self.faults, self.after_s), key=lambda pair: pair[1]):
            if isinstance(fault, NoFault):
                continue
            if isinstance(fault, PartitionFault) and fault.first_handshake:
                continue  # injected before the workload by inject_early()
            time.sleep(max(0.0, queued_at + after - time.monotonic()))
            with _quiet_during(fault):
                self._one(fault)

    def inject_early(self) -> None:
        """Faults that must be in place before any request (a first-handshake partition).

        Raises:
            leasekit.chaos.faults.FaultError: the rule could not be added.
        """
        for fault in self.faults:
            if isinstance(fault, PartitionFault) and fault.first_handshake:
                self._partition(fault)

    def _silenced(self, mono: float, wall: float) -> None:
        if self.silenced_at is None or mono < self.silenced_at[0]:
            self.silenced_at = (mono, wall)

    def _server(self, fault):
        return self.pair.decode if fault.target == "decode" else self.pair.prefill

    def _one(self, fault) -> None:
        if isinstance(fault, KillSpec):
            self._kill(fault)
        elif isinstance(fault, StallFault):
            self._stall(fault)
        elif isinstance(fault, HeartbeatFault):
            self._heartbeats(fault)
        elif isinstance(fault, PartitionFault):
            self._partition(fault)

    def _kill(self, fault: KillSpec) -> None:
        server = self._server(fault)
        injector = KillFault(server, signal.Signals[fault.signal], fault.scope)
        self.records.append(injector.record)
        injector.inject()
        start = injector.record["injected_monotonic_s"]
        self._progress(f"fault: {fault.signal} sent to {fault.target} ({fault.scope}), pids {injector.record.get('pids')}")
        self._silenced(start, injector.record["injected_wall_s"])
        self.d_killed = self.d_killed or fault.target == "decode"
        ok = fault.signal != "SIGKILL" or not injector.record.get("survivors")
        self.effects.append(Effect(f"kill {fault.target} ({fault.scope})", ok,
                                   f"signalled {injector.record.get('pids')}, survivors {injector.record.get('survivors')}"))
        end = None
        if fault.restart_after_s is not None and fault.target == "decode":
            time.sleep(fault.restart_after_s)
            self.pair.restart_decode(same_address=True)
            end = time.monotonic()
            self.records.append({"kind": "restart", "target": "decode", "restarted_monotonic_s": end, "same_address": True})
            self.d_killed = False
        self.windows.append((start, end, f"{fault.signal} {fault.target}"))

    def _writer_stall(self, fault: StallFault) -> None:
        """Arm a stall of P's push writer thread (LeaseKit's fault point before its next WRITE) and return: it
        starts when D's next registration is matched, so it overlaps what comes after it (D's slot released,
        other faults), like a partition; :meth:`finish_partition` waits for P's connector to report it."""
        control = FaultFile(self.pair, "prefill")
        armed, armed_wall = time.monotonic(), time.time()
        seq = control.write({"writer_stall_s": fault.duration_s})
        self._progress(f"fault: push writer stall of {fault.duration_s:g} s armed on P (at its next WRITE)")
        record = {"kind": "push_writer_stall", "target": "prefill", "seconds": fault.duration_s,
                  "armed_monotonic_s": armed, "armed_wall_s": armed_wall}
        self.records.append(record)
        self._writer_stalls.append((armed + fault.duration_s + WRITER_STALL_WAIT_S, control, seq, fault, record))

    def _finish_writer_stalls(self) -> None:
        """Wait (at most :data:`WRITER_STALL_WAIT_S` past each stall's duration) until P's connector reports each
        armed writer stall done. The stall's own start and end (P's clock, mapped through the state file's clock
        probes) become its window and the interval P's engine thread must have heard no heartbeat in."""
        for deadline, control, seq, fault, record in self._writer_stalls:
            state, stalls = {}, []
            while True:
                state = control.state() or {}
                stalls = (state.get("writer_stalls") or []) if state.get("seq") == seq else []
                if stalls or time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
            took = bool(stalls) and stalls[-1]["seconds"] >= 0.9 * fault.duration_s
            record["connector_state"] = stalls[-1] if stalls else None
            self.effects.append(Effect("push writer stall on prefill", took,
                                       f"P's connector reported a {stalls[-1]['seconds']:.3f} s writer stall" if stalls
                                       else "P's connector reported no writer stall (no WRITE came after it was armed)"))
            if not stalls:
                self.windows.append((record["armed_monotonic_s"], None, "push writer stall armed on P"))
                continue
            # P's perf_counter -> wall (the state's probe pair) -> this runner's monotonic clock
            start_wall = stalls[-1]["start_perf_s"] + float(state["time"]) - float(state["perf_counter"])
            start = start_wall + (time.monotonic() - time.time())
            record.update(injected_monotonic_s=start, injected_wall_s=start_wall)
            if took:
                self._expect_silence(start, start + stalls[-1]["seconds"], start_wall, 0.9 * fault.duration_s,
                                     f"push writer stall of {fault.duration_s:g} s on P")
            self.windows.append((start, start + stalls[-1]["seconds"], "push writer stall P"))
        self._writer_stalls = []

    def _stall(self, fault: StallFault) -> None:
        if fault.method == "push_writer":
            return self._writer_stall(fault)
        server = self._server(fault)
        if fault.method == "forward_pass":
            control = FaultFile(self.pair, fault.target)
            start, wall = time.monotonic(), time.time()
            seq = control.write({"forward_stall_s": fault.duration_s})
            self._progress(f"fault: forward-pass stall of {fault.duration_s:g} s asked on {fault.target}")
            record = {"kind": "forward_pass_stall", "target": fault.target, "seconds": fault.duration_s,
                      "injected_monotonic_s": start, "injected_wall_s": wall}
            self.records.append(record)
            deadline = start + fault.duration_s + 30
            state = None
            while time.monotonic() < deadline:
                state = control.state() or {}
                if state.get("seq") == seq and state.get("stalls"):
                    break
                time.sleep(0.1)
            stalls = (state or {}).get("stalls") or [] if (state or {}).get("seq") == seq else []
            took = bool(stalls) and stalls[-1]["seconds"] >= 0.9 * fault.duration_s
            record["connector_state"] = stalls[-1] if stalls else None
            self.effects.append(Effect(f"forward-pass stall on {fault.target}", took,
                                       f"connector reported {stalls[-1]['seconds']:.3f} s" if stalls else "connector reported no stall"))
            if fault.target == "decode":
                self._silenced(start, wall)
            if took:
                self._expect_silence(start, start + fault.duration_s, wall, 0.9 * fault.duration_s,
                                     f"forward-pass stall of {fault.duration_s:g} s on {fault.target}")
            self.windows.append((start, start + fault.duration_s, f"forward-pass stall {fault.target}"))
            return
        if host_of(server) is not None:  # on the server's own host
            injector = HostSigstopStall(server) if fault.method == "sigstop" else HostFreezerStall(server)
        else:
            injector = SigstopStall(server.pids) if fault.method == "sigstop" else FreezerStall(server.pids)
        self.records.append(injector.record)
        self._cleanups.append(injector.cleanup)
        try:
            injector.inject()
            start = injector.record["injected_monotonic_s"]
            self._progress(f"fault: {fault.target} stopped ({fault.method}) for {fault.duration_s:g} s")
            if fault.target == "decode":
                self._silenced(start, injector.record["injected_wall_s"])
            took = bool(injector.record.get("all_threads_stopped" if fault.method == "sigstop" else "frozen"))
            self.effects.append(Effect(f"{fault.method} stall on {fault.target}", took,
                                       f"record: { {k: v for k, v in injector.record.items() if not k.endswith('_s')} }"))
            time.sleep(max(0.0, start + fault.duration_s - time.monotonic()))
        finally:
            injector.recover() if hasattr(injector, "recover") else None
        self._expect_silence(start, time.monotonic(), injector.record["injected_wall_s"], 0.9 * fault.duration_s,
                             f"{fault.method} stall of {fault.duration_s:g} s on {fault.target}")
        self.windows.append((start, time.monotonic(), f"{fault.method} {fault.target} {fault.duration_s:g} s"))

    def _heartbeats(self, fault: HeartbeatFault) -> None:
        control_file = FaultFile(self.pair, "decode")
        control = {"heartbeats": {"drop_next": fault.drop_next, "drop_fraction": fault.drop_fraction,
                                  "delay_s": fault.delay_s, "duplicate": fault.duplicate, "delay_next_s": fault.delay_next_s}}
        start, wall = time.monotonic(), time.time()
        seq = control_file.write(control)
        self._progress(f"fault: heartbeat faults on D {control['heartbeats']}")
        record = {"kind": "heartbeats", **control["heartbeats"], "injected_monotonic_s": start, "injected_wall_s": wall}
        self.records.append(record)
        H = float(self.timing.heartbeat_interval_s)
        wait = (fault.drop_next + 3) * max(H, 0.5) + 10
        state: dict = {}
        deadline = start + wait
        def done(st: dict) -> bool:  # every asked-for effect seen at least once in D's connector
            return (len(st.get("dropped", [])) >= max(fault.drop_next, 1 if fault.drop_fraction else 0)
                    and st.get("delayed", 0) >= (1 if fault.delay_next_s or fault.delay_s else 0)
                    and st.get("duplicated", 0) >= (1 if fault.duplicate > 1 else 0))

        while time.monotonic() < deadline:
            state = control_file.state() or {}
            if state.get("seq") != seq:
                state = {}
            elif done(state):
                break
            time.sleep(0.1)
        dropped = state.get("dropped", [])
        record["dropped"] = dropped
        if dropped:
            first_wall = dropped[0]["wall_s"]
            first_mono = time.monotonic() - (time.time() - first_wall)
            self._silenced(first_mono, first_wall)
            last_mono = time.monotonic() - (time.time() - dropped[-1]["wall_s"])
            if fault.drop_next:
                self._expect_silence(first_mono, last_mono, first_wall, fault.drop_next * H,
                                     f"{len(dropped)} heartbeat batch(es) dropped on D")
        took = done(state)
        self.effects.append(Effect("heartbeat faults on D", took, f"{len(dropped)} batch(es) dropped (asked {fault.drop_next}"
                                   f"{f', fraction {fault.drop_fraction}' if fault.drop_fraction else ''}), "
                                   f"{state.get('delayed', 0)} delayed, {state.get('duplicated', 0)} duplicated"))
        if fault.duration_s:
            time.sleep(max(0.0, start + fault.duration_s - time.monotonic()))
            control_file.write({})
        self.windows.append((start, time.monotonic(), f"heartbeats: drop {fault.drop_next}"))

    def _partition(self, fault: PartitionFault) -> None:
        """Put the partition's rules in place in ``fault.target``'s host and return: a partition overlaps
        the faults after it, and :meth:`finish_partition` lifts it when its ``duration_s`` is over. One
        that silences D's heartbeats marks the instant D went silent (the reclaim bound counts from it)."""
        site = remote_site(self.pair) or PartitionSite.of_pair(self.pair)  # FaultError without two hosts
        rules = partition_rules(fault.path, fault.direction, fault.action, fault.loss_percent, fault.target, site)
        what = f"{fault.path} {fault.direction} ({fault.action}{f' {fault.loss_percent:g} %' if fault.action == 'loss' else ''})"
        details = {"path": fault.path, "direction": fault.direction, "action": fault.action,
                   "loss_percent": fault.loss_percent, "target": fault.target}
        host = host_of(self._server(fault))
        if host is not None:  # nft on the target's own host, its SSH port kept out of the rules
            injector = HostPartitionInjector(host, rules, ssh_port=getattr(host, "port", 22), details=details)
        else:
            injector = PartitionInjector(site.namespace(fault.target), rules, details=details)
        self.records.append(injector.record)
        self._cleanups.append(injector.cleanup)
        injector.inject()
        start, wall = injector.record["injected_monotonic_s"], injector.record["injected_wall_s"]
        silences = cuts_heartbeats(fault.path, fault.direction, fault.action, fault.loss_percent)
        if silences:
            self._silenced(start, wall)
        self._progress(f"fault: partition {what} in {fault.target}'s host for {fault.duration_s:g} s ({len(rules)} nftables rule(s))")
        self.effects.append(Effect(f"partition {what}", True, f"nft rules {injector.record['handles']} in {injector.namespace}"))
        self._partitions.append((start + fault.duration_s, injector, silences, what))

    def partitions_end(self) -> float:
        """When the last partition still in force is to be lifted, or an armed push writer stall may end at the
        latest (``time.monotonic()`` seconds; ``-inf`` with none)."""
        return max([item[0] for item in self._partitions] + [item[0] for item in self._writer_stalls],
                   default=float("-inf"))

    def finish_partition(self) -> None:
        """Wait until every armed push writer stall was reported (:meth:`_finish_writer_stalls`), then wait out
        every partition's duration and lift it (no-op without one); records how many
        packets its rules matched (a partition that matched nothing did not take effect), and for one
        that silenced D's heartbeats, that P must show a heartbeat gap as long as it (less 10 %)."""
        self._finish_writer_stalls()
        for end, injector, silences, what in sorted(self._partitions, key=lambda item: item[0]):
            time.sleep(max(0.0, end - time.monotonic()))
            injector.recover()
            packets = injector.record.get("packets_matched")
            self.effects.append(Effect(f"partition {what} matched traffic", bool(packets),
                                       f"nftables counters: {packets} packet(s) dropped or rejected"))
            start, now = injector.record["injected_monotonic_s"], time.monotonic()
            if silences:  # only where the rules surely held: between the two nft commands, not around them
                held_from = injector.record.get("in_force_monotonic_s", start)
                held_to = injector.record.get("lifting_monotonic_s", now)
                wall = injector.record.get("in_force_wall_s", injector.record["injected_wall_s"])
                self._expect_silence(held_from, held_to, wall, 0.9 * (held_to - held_from), f"partition {what}")
            self.windows.append((start, now, f"partition {what}"))
        self._partitions = []

    def cleanup(self) -> None:
        """Undo whatever is still in effect (SIGCONT, thaw, delete rules, clear control files)."""
        for cleanup in reversed(self._cleanups):
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - cleanup must go on
                pass
        for role in ("prefill", "decode"):
            FaultFile(self.pair, role).clear()
