"""Helpers shared by the fault injectors: pid sources, timestamps for ``record``, commands."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable

# who made a namespace or cgroup (one file per name holding the maker's pid): the scheme lives in the
# cluster layer, which the two-host testbed shares; re-exported for the fault injectors
from leasekit.cluster.owners import OWNERS_DIR, claim, owned_by_another_live_process, unclaim

__all__ = ["OWNERS_DIR", "FaultError", "PidsLike", "claim", "owned_by_another_live_process", "resolve_pids",
           "run", "stamp", "unclaim", "wait_for"]

#: Where an injector gets its target pids: a fixed list, or a callable read at ``inject()`` time
#: (e.g. ``server.pids``) so processes started after the injector was built are included.
PidsLike = Iterable[int] | Callable[[], Iterable[int]]


class FaultError(RuntimeError):
    """A fault could not be injected, recovered or cleaned up; the message says what and why."""


def resolve_pids(pids: PidsLike, field: str = "pids") -> list[int]:
    """Evaluate ``pids`` (list or callable) into a sorted list of unique positive ints.

    Raises:
        ValueError: an entry is not an int >= 1, or the result is empty (``field`` is named).
    """
    values = list(pids() if callable(pids) else pids)
    for pid in values:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid < 1:
            raise ValueError(f"{field}: every pid must be an int >= 1, got {pid!r}")
    if not values:
        raise ValueError(f"{field}: no pids to act on (need at least one pid >= 1)")
    return sorted(set(values))


def stamp(record: dict, event: str) -> None:
    """Record ``<event>_monotonic_s`` (``time.monotonic()``) and ``<event>_wall_s`` (``time.time()``)."""
    record[f"{event}_monotonic_s"] = time.monotonic()
    record[f"{event}_wall_s"] = time.time()


def run(argv: list[str], *, check: bool = True, timeout_s: float = 15.0,
        stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run ``argv`` (no shell), capturing text output.

    Raises:
        FaultError: ``check`` and the command failed or did not finish in ``timeout_s`` seconds;
            the message carries the command line and its stderr.
    """
    try:
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout_s,
                                check=False)
    except subprocess.TimeoutExpired as exc:
        raise FaultError(f"`{' '.join(argv)}` did not finish in {timeout_s} s") from exc
    except FileNotFoundError as exc:
        raise FaultError(f"`{argv[0]}` not found: {exc}") from exc
    if check and result.returncode != 0:
        raise FaultError(f"`{' '.join(argv)}` failed (exit {result.returncode}): {result.stderr.strip()}")
    return result


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.01) -> bool:
    """Poll ``predicate`` every ``interval_s`` seconds for up to ``timeout_s``; its last value."""
    from leasekit.cluster.procs import wait_until

    return wait_until(predicate, timeout_s, interval_s)
