"""Cgroup freezer plumbing for :mod:`leasekit.chaos.faults.stall`: find the hierarchies, detect
which freezer works here, freeze/thaw a cgroup, move processes, and sweep leftovers.

Two backends, detected at run time (a hybrid host can have both):

- ``v2``: the unified hierarchy (``/sys/fs/cgroup`` on a pure-v2 host, ``/sys/fs/cgroup/unified``
  on a hybrid one); write ``1``/``0`` to ``<child>/cgroup.freeze``, ``frozen 1`` in
  ``cgroup.events`` once every task is frozen.
- ``v1``: the ``freezer`` controller hierarchy; write ``FROZEN``/``THAWED`` to
  ``<child>/freezer.state``, which reads ``FREEZING`` until every task is frozen.
"""

from __future__ import annotations

import errno
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from leasekit.chaos.faults._common import FaultError, owned_by_another_live_process, unclaim, wait_for

Backend = Literal["v1", "v2"]
BACKENDS = ("v2", "v1")
PREFIX = "leasekit-"


@dataclass(frozen=True)
class FreezerDetection:
    """Which freezer works here: ``backend`` (``"v2"``, ``"v1"`` or None), the hierarchy's mount
    point ``root`` (None when no backend works) and ``reason`` (why this one, or why none)."""

    backend: Backend | None
    root: Path | None
    reason: str


def hierarchy_roots() -> dict[str, Path]:
    """Mount points of the cgroup2 hierarchy (``"v2"``) and the v1 freezer (``"v1"``), if mounted."""
    roots: dict[str, Path] = {}
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            parts = line.split()
            if len(parts) < 4:
                continue
            if parts[2] == "cgroup2":
                roots.setdefault("v2", Path(parts[1]))
            elif parts[2] == "cgroup" and "freezer" in parts[3].split(","):
                roots.setdefault("v1", Path(parts[1]))
    return roots


def set_frozen(backend: Backend, path: Path, frozen: bool) -> None:
    """Ask the kernel to freeze (``frozen=True``) or thaw cgroup ``path``; returns at once."""
    if backend == "v2":
        (path / "cgroup.freeze").write_text("1" if frozen else "0")
    else:
        (path / "freezer.state").write_text("FROZEN" if frozen else "THAWED")


def is_frozen(backend: Backend, path: Path) -> bool:
    """True once every task of cgroup ``path`` is frozen (v2 ``frozen 1``, v1 ``FROZEN``)."""
    if backend == "v2":
        return "frozen 1" in (path / "cgroup.events").read_text().splitlines()
    return (path / "freezer.state").read_text().strip() == "FROZEN"


def is_thawed(backend: Backend, path: Path) -> bool:
    """True once cgroup ``path`` is fully thawed (v2 ``frozen 0``, v1 ``THAWED``)."""
    if backend == "v2":
        return "frozen 0" in (path / "cgroup.events").read_text().splitlines()
    return (path / "freezer.state").read_text().strip() == "THAWED"


def cgroup_of(pid: int, backend: Backend) -> str:
    """``pid``'s cgroup path (``"/..."``) relative to the ``backend`` hierarchy's root.

    Raises:
        ProcessLookupError: no such process.
    """
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid}") from None
    for line in lines:
        hierarchy_id, controllers, path = line.split(":", 2)
        if backend == "v2" and hierarchy_id == "0" and controllers == "":
            return path
        if backend == "v1" and "freezer" in controllers.split(","):
            return path
    return "/"


def move(pid: int, cgroup: Path) -> bool:
    """Write ``pid`` to ``cgroup/cgroup.procs`` (moves every thread); False if the pid is gone."""
    try:
        (cgroup / "cgroup.procs").write_text(str(pid))
        return True
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return False
        raise


def member_pids(cgroup: Path) -> list[int]:
    """Pids listed in ``cgroup/cgroup.procs`` (empty if the cgroup is gone)."""
    try:
        return [int(x) for x in (cgroup / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def release(backend: Backend, path: Path, root: Path, timeout_s: float = 5.0) -> None:
    """Thaw cgroup ``path``, move every process left in it to ``root``, and remove it.

    Raises:
        FaultError: it could not be thawed or removed within ``timeout_s`` seconds.
    """
    if not path.exists():
        return
    set_frozen(backend, path, False)
    if not wait_for(lambda: is_thawed(backend, path), timeout_s):
        raise FaultError(f"cgroup {path} did not thaw within {timeout_s} s")
    for pid in member_pids(path):
        move(pid, root)

    def removed() -> bool:
        try:
            path.rmdir()
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            for pid in member_pids(path):  # forked while we were moving the others
                move(pid, root)
            return False
        return True

    if not wait_for(removed, timeout_s, interval_s=0.05):
        raise FaultError(f"cgroup {path} could not be removed (busy) within {timeout_s} s")


def _probe(backend: Backend, root: Path) -> str | None:
    """Freeze and thaw a throwaway ``sleep`` in a fresh child of ``root``; None if it all worked,
    else what failed."""
    path = root / f"{PREFIX}probe-{uuid.uuid4().hex[:12]}"
    sleeper = None
    try:
        path.mkdir()
        control = "cgroup.freeze" if backend == "v2" else "freezer.state"
        if not (path / control).exists():
            return f"{path} has no {control} (kernel without the {backend} freezer)"
        sleeper = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL)
        move(sleeper.pid, path)
        set_frozen(backend, path, True)
        if not wait_for(lambda: is_frozen(backend, path), 2.0):
            return f"{path} did not report frozen within 2 s"
        return None
    except OSError as exc:
        return f"{backend} freezer at {root}: {exc}"
    finally:
        try:
            release(backend, path, root)
        except (OSError, FaultError):
            pass
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()


def detect_freezer(prefer: tuple[str, ...] = BACKENDS) -> FreezerDetection:
    """Find a freezer that really works here, trying backends in ``prefer`` order.

    A backend counts only if a new child cgroup accepts a ``cgroup.procs`` write and then
    freezes a real process (a ``sleep`` started for the probe and killed after it).

    Raises:
        ValueError: ``prefer`` names something other than ``"v1"``/``"v2"``.
    """
    for name in prefer:
        if name not in BACKENDS:
            raise ValueError(f"prefer: backends must be among {BACKENDS}, got {name!r}")
    roots = hierarchy_roots()
    reasons = []
    for name in prefer:
        if name not in roots:
            reasons.append(f"{name}: not mounted")
            continue
        failure = _probe(name, roots[name])  # type: ignore[arg-type]
        if failure is None:
            return FreezerDetection(name, roots[name], f"{name} freezer at {roots[name]} froze a probe process")  # type: ignore[arg-type]
        reasons.append(failure)
    return FreezerDetection(None, None, "no working cgroup freezer: " + "; ".join(reasons))


def leftover_cgroups(prefix: str = PREFIX) -> list[tuple[Backend, Path, Path]]:
    """``(backend, cgroup, root)`` for every child cgroup named ``prefix*`` at a hierarchy root.

    Raises:
        ValueError: ``prefix`` does not start with ``leasekit-`` (we only sweep our own).
    """
    if not prefix.startswith(PREFIX):
        raise ValueError(f"prefix must start with {PREFIX!r} (only leasekit's cgroups are swept), got {prefix!r}")
    found = []
    for backend, root in sorted(hierarchy_roots().items()):
        for path in sorted(root.glob(f"{prefix}*")):
            if path.is_dir():
                found.append((backend, path, root))
    return found


def cleanup_stale_cgroups(prefix: str = PREFIX) -> list[str]:
    """Thaw and remove leftover ``prefix*`` cgroups (a crashed run's), in every hierarchy.

    Their processes go to the hierarchy root (their original cgroups are not known any more).
    Returns the paths removed.

    Raises:
        ValueError: ``prefix`` does not start with ``leasekit-``.
        FaultError: some could not be removed (all others still are); the message lists them.
    """
    removed, failed = [], []
    for backend, path, root in leftover_cgroups(prefix):
        if owned_by_another_live_process(path.name):  # another run's stall, still going
            continue
        try:
            release(backend, path, root)
            unclaim(path.name)
            removed.append(str(path))
        except (OSError, FaultError) as exc:
            failed.append(f"{path}: {exc}")
    if failed:
        raise FaultError("could not remove stale cgroups: " + "; ".join(failed))
    return removed


def list_leftovers(prefix: str = PREFIX) -> list[str]:
    """Paths of every ``prefix*`` cgroup still present (empty when all was cleaned up).

    Raises:
        ValueError: ``prefix`` does not start with ``leasekit-``.
    """
    return [str(path) for _, path, _ in leftover_cgroups(prefix)]
