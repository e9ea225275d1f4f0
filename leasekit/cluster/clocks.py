"""Clock domains of processes on this host.

``time.perf_counter`` and ``time.monotonic`` are both ``CLOCK_MONOTONIC`` on Linux: one clock for
every process of a time namespace. A process in another time namespace (``unshare --time``) sees
it shifted by its namespace's offset, which the kernel publishes in ``/proc/<pid>/timens_offsets``
(``monotonic <seconds> <nanoseconds>``). Converting between two processes' monotonic clocks by that
measured offset keeps invariant 4 (clock hygiene, docs/lease-model.md) without assuming one clock.
"""

from __future__ import annotations

import os


def monotonic_namespace_offset_s(pid: int | str = "self") -> float:
    """The CLOCK_MONOTONIC offset (seconds) of ``pid``'s time namespace against the initial one.

    Returns 0.0 when the kernel has no time namespaces (no ``timens_offsets`` file).

    Raises:
        ProcessLookupError: ``pid`` does not exist.
    """
    path = f"/proc/{pid}/timens_offsets"
    try:
        with open(path, encoding="ascii") as handle:
            for line in handle:
                parts = line.split()
                if len(parts) == 3 and parts[0] in ("monotonic", "1"):
                    return int(parts[1]) + int(parts[2]) / 1e9
    except FileNotFoundError:
        if not os.path.exists(f"/proc/{pid}"):
            raise ProcessLookupError(f"no process {pid}") from None
    return 0.0


def to_process_monotonic(t_self_s: float, pid: int) -> float:
    """Convert a ``time.monotonic()`` reading of this process to ``pid``'s monotonic clock (seconds)."""
    return t_self_s + monotonic_namespace_offset_s(pid) - monotonic_namespace_offset_s("self")
