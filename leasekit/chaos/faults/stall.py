"""Stall faults: stop every thread of some processes for a while, then let them run again.

- :class:`SigstopStall`: ``SIGSTOP`` each pid (the kernel stops all its threads; ``/proc`` state
  ``T``), ``SIGCONT`` on recover. Visible to the target's parent (``waitpid`` ``WUNTRACED``).
- :class:`FreezerStall`: the cgroup freezer (v2 ``cgroup.freeze`` or v1 ``freezer.state``,
  detected at run time by :func:`detect_freezer`); invisible to the processes themselves and it
  also freezes children they fork while frozen-in.

Every injector has ``inject``, ``recover`` and an idempotent ``cleanup`` that always leaves the
processes running (and, for the freezer, back in their original cgroups with ours removed).
``record`` (filled in place) holds what was done, with ``*_monotonic_s`` (``time.monotonic()``)
and ``*_wall_s`` (``time.time()``) stamps.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

from leasekit.chaos.faults import _cgroup
from leasekit.chaos.faults._cgroup import (
    FreezerDetection,
    cleanup_stale_cgroups,
    detect_freezer,
    list_leftovers,
)
from leasekit.chaos.faults._common import (
    FaultError,
    PidsLike,
    claim,
    unclaim,
    resolve_pids,
    stamp,
    wait_for,
)

__all__ = [
    "FreezerDetection",
    "FreezerStall",
    "SigstopStall",
    "cleanup_stale_cgroups",
    "detect_freezer",
    "list_leftovers",
    "thread_states",
]


def thread_states(pid: int) -> list[str]:
    """The scheduler state letter (``R``, ``S``, ``T``, ``D``...) of every thread of ``pid``.

    Returns an empty list if the process is gone.
    """
    states = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        states.append(stat.rsplit(")", 1)[1].split()[0])
    return states


class SigstopStall:
    """Stop ``pids`` (a list or a callable such as ``server.pids``, read at ``inject`` time) with
    ``SIGSTOP``; ``recover`` sends ``SIGCONT``. ``record``: ``pids``, ``missing``,
    ``stopped_pids``, ``all_threads_stopped`` and ``injected_*``/``stopped_*``/``recovered_*``
    stamps.

    Args:
        pids: target pids, or a callable returning them.
        settle_timeout_s: how long ``inject`` waits (seconds, > 0) for every thread to show ``T``.

    Raises:
        ValueError: ``settle_timeout_s`` is not > 0.
    """

    def __init__(self, pids: PidsLike, *, settle_timeout_s: float = 2.0):
        if not settle_timeout_s > 0:
            raise ValueError(f"settle_timeout_s must be > 0 seconds, got {settle_timeout_s!r}")
        self.pids = pids
        self.settle_timeout_s = settle_timeout_s
        self.record: dict = {}
        self._stopped: list[int] = []

    def inject(self) -> None:
        """SIGSTOP every target and wait until all their threads are stopped.

        Raises:
            ValueError: no pids, or a pid is not an int >= 1.
            FaultError: already injected, or none of the pids exists.
        """
        if self._stopped:
            raise FaultError(f"SigstopStall already injected on {self._stopped}")
        targets = resolve_pids(self.pids)
        self.record.clear()
        self.record.update({"kind": "sigstop", "pids": targets, "missing": []})
        stamp(self.record, "injected")
        try:
            for pid in targets:
                try:
                    os.kill(pid, signal.SIGSTOP)
                    self._stopped.append(pid)
                except ProcessLookupError:
                    self.record["missing"].append(pid)
        except BaseException:  # e.g. PermissionError: never leave the others stopped
            self.recover()
            raise
        if not self._stopped:
            raise FaultError(f"SigstopStall: none of the pids {targets} exists")
        settled = wait_for(lambda: all(set(thread_states(p)) <= {"T", "t"} for p in self._stopped),
                           self.settle_timeout_s)
        self.record["stopped_pids"] = list(self._stopped)
        self.record["all_threads_stopped"] = settled
        stamp(self.record, "stopped")

    def recover(self) -> None:
        """SIGCONT every process this stall stopped (gone ones are skipped); no-op if none."""
        if not self._stopped:
            return
        for pid in self._stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self._stopped = []
        stamp(self.record, "recovered")

    def cleanup(self) -> None:
        """SIGCONT anything still stopped by this stall; idempotent."""
        self.recover()


class FreezerStall:
    """Freeze ``pids`` with the cgroup freezer.

    ``inject`` creates a child cgroup ``leasekit-<uuid hex>`` (:attr:`cgroup_name`) at the root of
    the detected hierarchy, remembers each pid's cgroup, moves the pids in and freezes it, waiting
    until the kernel reports it frozen. ``recover`` thaws; ``cleanup`` thaws, moves the pids back
    to their original cgroups (children forked inside go to the first pid's) and removes the child.
    ``record``: ``backend``, ``cgroup`` (path), ``pids``, ``moved``, ``missing``, ``origins``
    (``{pid: original cgroup}``), ``frozen`` and ``injected_*``/``frozen_*``/``recovered_*``/
    ``cleaned_up_*`` stamps. The cgroup v2 freezer shows frozen tasks as ``S`` in ``/proc``, the
    v1 freezer as ``D``: check ``record["frozen"]`` (the kernel's own report), not ``/proc``.

    Args:
        pids: target pids, or a callable returning them.
        backend: ``"v2"``, ``"v1"``, or None to use the first that works (v2 preferred).
        timeout_s: how long (seconds, > 0) to wait for the freeze/thaw to take effect.

    Raises:
        ValueError: ``backend`` not None/``"v1"``/``"v2"``, or ``timeout_s`` not > 0.
    """

    def __init__(self, pids: PidsLike, *, backend: str | None = None, timeout_s: float = 5.0):
        if backend not in (None, *_cgroup.BACKENDS):
            raise ValueError(f"backend must be None, 'v1' or 'v2', got {backend!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.pids = pids
        self.backend = backend
        self.timeout_s = timeout_s
        self.cgroup_name = f"{_cgroup.PREFIX}{uuid.uuid4().hex}"
        self.record: dict = {}
        self.path: Path | None = None
        self._root: Path | None = None
        self._kind: str | None = None
        self._origins: dict[int, str] = {}

    def inject(self) -> None:
        """Move the pids into a new frozen cgroup; on any failure everything is undone.

        Raises:
            ValueError: no pids, or a pid is not an int >= 1.
            FaultError: already injected, no working freezer (the reason is given), or the
                cgroup did not report frozen within ``timeout_s``.
        """
        if self.path is not None:
            raise FaultError(f"FreezerStall already injected ({self.path})")
        targets = resolve_pids(self.pids)
        found = detect_freezer((self.backend,) if self.backend else _cgroup.BACKENDS)
        if found.backend is None or found.root is None:
            raise FaultError(found.reason)
        self._kind, self._root = found.backend, found.root
        path = found.root / self.cgroup_name
        self.record.clear()
        self.record.update({"kind": "freezer", "backend": found.backend, "cgroup": str(path),
                            "pids": targets, "moved": [], "missing": []})
        stamp(self.record, "injected")
        try:
            path.mkdir()
            self.path = path
            claim(self.cgroup_name)
            for pid in targets:
                try:
                    origin = _cgroup.cgroup_of(pid, found.backend)
                except ProcessLookupError:
                    self.record["missing"].append(pid)
                    continue
                if _cgroup.move(pid, path):
                    self._origins[pid] = origin
                    self.record["moved"].append(pid)
                else:
                    self.record["missing"].append(pid)
            if not self._origins:
                raise FaultError(f"FreezerStall: none of the pids {targets} exists")
            self.record["origins"] = dict(self._origins)
            _cgroup.set_frozen(found.backend, path, True)
            if not wait_for(lambda: _cgroup.is_frozen(found.backend, path), self.timeout_s):
                raise FaultError(f"cgroup {path} did not report frozen within {self.timeout_s} s")
            self.record["frozen"] = True
            stamp(self.record, "frozen")
        except BaseException:
            self.cleanup()
            raise

    def recover(self) -> None:
        """Thaw the cgroup (the processes stay in it until ``cleanup``); no-op if not injected.

        Raises:
            FaultError: it did not report thawed within ``timeout_s``.
        """
        if self.path is None or self._kind is None:
            return
        _cgroup.set_frozen(self._kind, self.path, False)
        if not wait_for(lambda: _cgroup.is_thawed(self._kind, self.path), self.timeout_s):
            raise FaultError(f"cgroup {self.path} did not thaw within {self.timeout_s} s")
        stamp(self.record, "recovered")

    def cleanup(self) -> None:
        """Thaw, move every process back to where it came from, remove the cgroup; idempotent.

        Raises:
            FaultError: the cgroup could not be thawed or removed (a retry may succeed).
        """
        path, kind, root = self.path, self._kind, self._root
        if path is None or kind is None or root is None:
            return
        if path.exists():
            _cgroup.set_frozen(kind, path, False)
            wait_for(lambda: _cgroup.is_thawed(kind, path), self.timeout_s)
            fallback = root / next(iter(self._origins.values()), "/").lstrip("/")
            for pid in _cgroup.member_pids(path):
                origin = self._origins.get(pid)
                target = root / origin.lstrip("/") if origin else fallback
                try:
                    _cgroup.move(pid, target if target.is_dir() else root)
                except OSError:  # e.g. the original cgroup no longer takes processes
                    _cgroup.move(pid, root)
            _cgroup.release(kind, path, root, self.timeout_s)
        unclaim(self.cgroup_name)
        self.path = None
        self._origins = {}
        stamp(self.record, "cleaned_up")


def plan_commands(target: str, method: str, duration_s: float, *, backend: str = "v2",
                  root: str = "/sys/fs/cgroup") -> list[dict]:
    """What :class:`SigstopStall` / :class:`FreezerStall` would do to the server ``target`` for
    ``duration_s`` seconds, as plan steps (``{"argv": [...], "what": ...}`` or ``{"write": path,
    "content": text, "what": ...}``); nothing is run. ``backend``/``root``: the freezer hierarchy
    (``v2`` at ``/sys/fs/cgroup`` unless the caller detected another). Pids and the cgroup's random
    suffix are placeholders.

    Raises:
        ValueError: ``method`` not ``sigstop``/``freezer``, or ``backend`` not ``v1``/``v2``.
    """
    pids = f"<each pid in the {target} process group>"
    if method == "sigstop":
        return [{"argv": ["kill", "-STOP", pids], "what": f"stop every process of {target} (wait until all threads show T)"},
                {"argv": ["sleep", f"{duration_s:g}"], "what": "the stall"},
                {"argv": ["kill", "-CONT", pids], "what": f"resume {target}"}]
    if method != "freezer":
        raise ValueError(f"method must be 'sigstop' or 'freezer' (forward_pass goes through the fault file), got {method!r}")
    if backend not in _cgroup.BACKENDS:
        raise ValueError(f"backend must be one of {_cgroup.BACKENDS}, got {backend!r}")
    path = f"{root}/{_cgroup.PREFIX}<uuid>"
    control, freeze, thaw = ("cgroup.freeze", "1", "0") if backend == "v2" else ("freezer.state", "FROZEN", "THAWED")
    probe = f"{root}/{_cgroup.PREFIX}probe-<id>"
    return [
        {"argv": ["mkdir", probe], "what": f"detect the {backend} freezer: a probe cgroup freezes and thaws a "
                                           "throwaway `sleep 30`, then is removed"},
        {"argv": ["mkdir", path], "what": f"a fresh cgroup for {target}"},
        {"write": f"{path}/cgroup.procs", "content": pids, "what": f"move {target}'s processes in (original cgroups remembered)"},
        {"write": f"{path}/{control}", "content": freeze, "what": "freeze (wait until the kernel reports frozen)"},
        {"argv": ["sleep", f"{duration_s:g}"], "what": "the stall"},
        {"write": f"{path}/{control}", "content": thaw, "what": "thaw"},
        {"write": f"{root}/<original cgroup of each pid>/cgroup.procs", "content": pids, "what": "move them back"},
        {"argv": ["rmdir", path], "what": "remove the cgroup"},
    ]
