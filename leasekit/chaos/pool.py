"""Pairs for a chaos suite: start one per (target, launch conditions), reuse it across scenarios,
restart D after a scenario killed it, and tear everything down at the end (engines take 20-60 s to
start on this class of machine, so sharing matters)."""

from __future__ import annotations

from pathlib import Path

from leasekit.chaos.scenario import Scenario
from leasekit.chaos.schema import CONNECTOR_STALLS, HeartbeatFault, NoFault, StallFault
from leasekit.cluster.pair import PairSpec, PDPair


def _remote(spec: PairSpec) -> bool:
    """Whether ``spec`` runs a server on another host (no idle spares there: no head start)."""
    return spec.deployment is not None and bool(spec.deployment.remote_roles())


def pair_spec(scenario: Scenario, target: str, deployment=None) -> PairSpec:
    """The pair ``scenario`` needs on ``target`` (``leasekit``: fault-control files on; ``stock``:
    millisecond lease logging on, the stock connector's only evidence), deployed as ``deployment``
    says (a :class:`leasekit.cluster.pairfile.PairFile`; None: the CPU default)."""
    launch = scenario.launch
    return PairSpec.pinned(
        prefill_connector=target,
        decode_connector=target,
        lease_duration_s=scenario.lease.timing().lease_duration_s,
        decode_max_num_seqs=scenario.topology.decode_max_num_seqs,
        transfer_mode=scenario.topology.transfer_mode,
        prefill_monotonic_offset_s=launch.prefill_monotonic_offset_s,
        decode_monotonic_offset_s=launch.decode_monotonic_offset_s,
        prefill_wall_offset_s=launch.prefill_wall_offset_s,
        prefill_wall_rate=launch.prefill_wall_rate,
        decode_wall_offset_s=launch.decode_wall_offset_s,
        decode_wall_rate=launch.decode_wall_rate,
        network_namespace=launch.network_namespace,
        fault_files=target == "leasekit",
        lease_logging=target == "stock",
        warm_up=launch.warm_up,
        fail_closed=launch.fail_closed and target == "leasekit",
        deployment=deployment,
    )


class PairPool:
    """Hands out started pairs. ``get`` reuses the current pair when the launch conditions match
    and it may be reused; otherwise it stops it and starts a new one under ``run_dir/pairs/<n>``.

    ``prefetch`` warms up what the next scenario needs while the current one runs: a spare D (when
    the current scenario will kill D) or the next pair (when the launch conditions change),
    as background work (``SCHED_BATCH``, nice 10: never preempting the running scenario's threads; with
    the kernel's autogroups on, nice weighs only within a server's own session, so a warming spare still
    shares the CPU with the running pair), taking the ~45 s of engine imports off the critical path.
    """

    def __init__(self, run_dir: str | Path, *, start_timeout_s: float = 300.0, say=print):
        self.run_dir = Path(run_dir)
        self.start_timeout_s = start_timeout_s
        self.say = say
        self.current: PDPair | None = None
        self.spare_pairs: dict[tuple, PDPair] = {}
        self.spare_decodes: list = []
        self._reusable = False
        self._count = 0
        self.started: list[str] = []

    def _matches_current(self, spec: PairSpec) -> bool:
        pair = self.current
        return pair is not None and self._reusable and pair.spec.launch_key() == spec.launch_key() and pair.prefill.alive()

    def _new_pair(self, spec: PairSpec) -> PDPair:
        self._count += 1
        directory = self.run_dir / "pairs" / f"{self._count:02d}-{spec.prefill_connector}"
        return PDPair(spec, directory, start_timeout_s=self.start_timeout_s)

    @staticmethod
    def _describe(spec: PairSpec) -> str:
        return (f"{spec.prefill_connector}, L={spec.lease_duration_s} s"
                f"{', on two hosts' if spec.network_namespace else ''}"
                f"{', D clock +%gs' % spec.decode_monotonic_offset_s if spec.decode_monotonic_offset_s else ''}"
                f"{', P clock +%gs' % spec.prefill_monotonic_offset_s if spec.prefill_monotonic_offset_s else ''}"
                f"{', D wall clock faked' if spec.decode_wall_offset_s or spec.decode_wall_rate != 1 else ''}"
                f"{', cold (D has not met P)' if not spec.warm_up else ''}"
                f"{', P on %s, D on %s (pair file)' % (spec.deployment.prefill.device, spec.deployment.decode.device) if spec.deployment is not None else ''}")

    def get(self, spec: PairSpec) -> PDPair:
        """A started pair for ``spec`` (D replaced if a previous scenario killed it).

        Raises:
            ServerStartError / WarmUpError: a pair could not be started (it is stopped).
        """
        pair = self.current
        if self._matches_current(spec):
            if not (pair.decode.alive() and pair.decode.healthy()):
                spare = self.spare_decodes.pop(0) if self.spare_decodes else None
                if spare is not None and not spare.alive():
                    spare.stop(grace_s=1)  # died warming up: close its log, remove its IPC socket directory
                if spare is not None and spare.alive():
                    self.say("D was taken down: promoting the spare D started in the background")
                    try:
                        pair.adopt_decode(spare)
                        return pair
                    except Exception as exc:  # noqa: BLE001 - fall back to a plain restart
                        self.say(f"the spare D did not come up ({type(exc).__name__}); restarting D")
                self.say("restarting D (a previous scenario took it down; 30-60 s)")
                pair.restart_decode(same_address=True)
            return pair
        self.close_current()
        spare = self.spare_pairs.pop(spec.launch_key(), None)
        if spare is not None and not spare.prefill.alive():
            spare.stop()
            spare = None
        if spare is not None:
            self.say(f"promoting the pair started in the background ({self._describe(spec)}) in {spare.run_dir}")
            pair = spare
        else:
            pair = self._new_pair(spec)
            self.say(f"starting P and D ({self._describe(spec)}) in {pair.run_dir} (30-60 s)")
        self.current = pair
        pair.start()
        self.started.append(str(pair.run_dir))
        self._reusable = spec.warm_up  # a pair started cold is used up once D has met P
        return pair

    def prefetch_decode(self, count: int = 1) -> None:
        """Keep ``count`` spare Ds for the current pair starting in the background, each to
        replace D when a scenario kills it. Failures only cost the head start."""
        if self.current is None or _remote(self.current.spec):
            return
        try:
            while len(self.spare_decodes) < count:
                self.spare_decodes.append(self.current.spare_decode())
        except Exception as exc:  # noqa: BLE001 - a head start is an optimisation
            self.say(f"could not start a spare D in the background ({type(exc).__name__}: {exc})")

    def prefetch_pair(self, spec: PairSpec) -> None:
        """Start the pair for ``spec`` in the background (if not already), for a later
        ``get(spec)``. Failures only cost the head start."""
        if spec.launch_key() in self.spare_pairs or _remote(spec):
            return
        try:
            self.spare_pairs[spec.launch_key()] = self._new_pair(spec).launch(idle=True)
        except Exception as exc:  # noqa: BLE001 - a head start is an optimisation
            self.say(f"could not start a pair in the background ({type(exc).__name__}: {exc})")

    def park_ready_spares(self) -> list[str]:
        """SIGSTOP every spare server that has become healthy (vLLM engines busy-poll even when
        idle: a ready spare would otherwise take CPU from the running scenario); returns their logs."""
        servers = list(self.spare_decodes)
        for pair in self.spare_pairs.values():
            servers += [pair.prefill, pair.decode]
        return [str(server.log_path) for server in servers if server.park()]

    def release(self, *, reusable: bool) -> None:
        """Say whether the current pair may serve another scenario."""
        self._reusable = self._reusable and reusable

    def close_current(self) -> None:
        """Stop the current pair and its spare Ds (idempotent)."""
        while self.spare_decodes:
            self.spare_decodes.pop().stop(grace_s=2)
        if self.current is not None:
            self.current.stop()
            self.current = None

    def close(self) -> None:
        """Stop the current pair and every spare (idempotent)."""
        self.close_current()
        while self.spare_pairs:
            self.spare_pairs.popitem()[1].stop()


class ExternalPool:
    """Hands out one already running pair (:class:`leasekit.cluster.external.ExternalPair`) for
    every scenario it can stand in for; ``get`` raises for the others, with the reason."""

    def __init__(self, pair, *, say=print):
        self.pair = pair
        self.say = say
        self.started: list[str] = []
        self._open = False

    def get(self, spec: PairSpec):
        """The external pair, once checked healthy.

        Raises:
            leasekit.cluster.external.ExternalPairError: it cannot serve ``spec``, or does not answer.
        """
        from leasekit.cluster.external import ExternalPairError

        why = self.pair.matches(spec)
        if why:
            raise ExternalPairError(why)
        if not self._open:
            self.say(f"using the running pair P={self.pair.prefill.url} D={self.pair.decode.url}")
            self.pair.start()
            self.started.append(f"external P={self.pair.prefill.url} D={self.pair.decode.url} dir={self.pair.run_dir}")
            self._open = True
        return self.pair

    def release(self, *, reusable: bool) -> None:  # noqa: ARG002
        """Nothing to do: the pair is not ours to restart."""

    def close(self) -> None:
        """Close the router; the servers keep running."""
        self.pair.stop()
        self._open = False


def unsupported_reason(scenario) -> str | None:
    """Why ``scenario`` (a :class:`leasekit.chaos.scenario.Scenario`) cannot run on an external pair
    (:class:`leasekit.cluster.external.ExternalPair`), or None if it can: faults that need the
    processes (kill, SIGSTOP/freezer stall, nftables partition) or launch conditions. Heartbeat
    faults and forward-pass stalls go through the fault files and are fine."""
    for fault in scenario.faults:
        if isinstance(fault, (NoFault, HeartbeatFault)):
            continue
        if isinstance(fault, StallFault) and fault.method in CONNECTOR_STALLS:
            continue
        return f"a {fault.kind} fault ({getattr(fault, 'method', getattr(fault, 'scope', ''))}) needs the processes of a pair leasekit started"
    if scenario.launch != type(scenario.launch)():
        return "launch conditions (clock skew, network namespace, cold start) need a pair leasekit starts"
    return None
