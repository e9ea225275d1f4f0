"""Who made a namespace, bridge or cgroup: one file per name under :data:`OWNERS_DIR` holding the
pid of the leasekit process that made it, so that one run's sweep of stale leftovers never removes
what another, still running, run is using (two runs on one host, or a test beside a suite).
"""

from __future__ import annotations

import os

OWNERS_DIR = "/run/leasekit/owners"
"""Directory of the owner files (one per claimed name; root-only, like the things claimed)."""


def claim(name: str) -> None:
    """Mark ``name`` (a namespace, link or cgroup name) as made by this process (best effort: an
    unwritable directory only weakens the protection against a concurrent sweep)."""
    try:
        os.makedirs(OWNERS_DIR, exist_ok=True)
        with open(os.path.join(OWNERS_DIR, name), "w") as handle:
            handle.write(str(os.getpid()))
    except OSError:
        pass


def unclaim(name: str) -> None:
    """Forget the owner of ``name`` (it was removed); no error if it had none."""
    try:
        os.unlink(os.path.join(OWNERS_DIR, name))
    except OSError:
        pass


def owned_by_another_live_process(name: str) -> bool:
    """True when another process that is still alive claimed ``name`` (so a sweep must leave it);
    False when nobody claimed it, this process did, or its owner is gone."""
    try:
        with open(os.path.join(OWNERS_DIR, name)) as handle:
            pid = int(handle.read().strip())
    except (OSError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
