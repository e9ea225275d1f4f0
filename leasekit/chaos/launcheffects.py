"""Evidence that a scenario's launch-time conditions (clock offsets, a faked wall clock) are really
in force on the started servers: a PASS must not come from a condition that never took."""

from __future__ import annotations

from typing import Iterable

from leasekit.chaos.actions import Effect
from leasekit.chaos.faults.onhost import host_of, monotonic_offset_on_host
from leasekit.chaos.schema import LaunchSection
from leasekit.cluster.clocks import monotonic_namespace_offset_s
from leasekit.cluster.router import DecodeResult


def launch_effects(launch: LaunchSection, pair) -> list[Effect]:
    """One effect per monotonic clock offset in ``launch`` (seconds): the offset read back from
    the server's ``/proc/<pid>/timens_offsets`` (on its own host when remote) must equal it within
    1 microsecond. ``pair``: the started :class:`leasekit.cluster.pair.PDPair`."""
    effects = []
    for role, offset in (("prefill", launch.prefill_monotonic_offset_s), ("decode", launch.decode_monotonic_offset_s)):
        if not offset:
            continue
        server = pair.prefill if role == "prefill" else pair.decode
        pid = server.api_server_pid()
        host = host_of(server)  # on another host: read there
        measured = None if pid is None else monotonic_offset_on_host(host, pid) if host else monotonic_namespace_offset_s(pid)
        effects.append(Effect(f"{role} monotonic clock +{offset:g} s", measured is not None and abs(measured - offset) < 1e-6,
                              f"/proc/{pid}/timens_offsets: monotonic {measured}"))
    return effects


def wall_clock_effects(launch: LaunchSection, decodes: Iterable[DecodeResult]) -> list[Effect]:
    """Evidence that a faked wall clock (libfaketime) is in force on D: the ``created`` epoch
    seconds of D's answers (``decodes``) against the host's clock when they arrived. Taken when
    the skew is at least half the configured offset, or over 1 s for a rate alone; empty when
    ``launch`` fakes no wall clock on D."""
    if not launch.decode_wall_offset_s and launch.decode_wall_rate == 1.0:
        return []
    skews = [d.created - d.done_wall_s for d in decodes if d.ok and d.created]
    if not skews:
        return [Effect("D wall clock faked", False, "no answer from D carried a 'created' time")]
    skew = sum(skews) / len(skews)
    took = abs(skew) >= 0.5 * abs(launch.decode_wall_offset_s) if launch.decode_wall_offset_s else abs(skew) > 1.0
    return [Effect(f"D wall clock {launch.decode_wall_offset_s:+g} s x{launch.decode_wall_rate:g}", took,
                   f"D's answers say 'created' {skew:+.1f} s from the host clock ({len(skews)} answers)")]
