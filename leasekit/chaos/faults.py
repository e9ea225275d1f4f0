"""The nemesis: fault injectors act on real processes, never on the checks.

Each injector has ``inject`` and a guaranteed ``cleanup`` (idempotent), and records what it did
(``record``) for the report.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

from leasekit.cluster.server import VllmServer


@dataclass
class KillFault:
    """Send ``sig`` to a server's whole process group (API server, engine core, workers).

    After a SIGKILL it verifies that no process of the group survived; ``record`` says which pids
    were signalled, when (``time.monotonic()``, this process) and whether the group is gone.
    """

    server: VllmServer
    sig: signal.Signals = signal.SIGKILL
    record: dict = field(default_factory=dict)

    def inject(self) -> None:
        """Signal the group now.

        Raises:
            RuntimeError: the server was not running.
        """
        if not self.server.alive():
            raise RuntimeError(f"cannot kill {self.server.spec.name}: it is not running")
        # Recorded (in place: callers may hold the dict) before the signal goes out, so an
        # interrupted run still knows the fault happened.
        self.record.clear()
        self.record.update({
            "kind": "kill",
            "target": self.server.spec.name,
            "signal": self.sig.name,
            "pids": self.server.pids(),
            "injected_monotonic_s": time.monotonic(),
        })
        self.record["pids"] = self.server.kill(self.sig) or self.record["pids"]
        self.record["survivors"] = self.server.pids() if self.sig == signal.SIGKILL else []

    def cleanup(self) -> None:
        """Make sure nothing of the group is left (a killed server stays down)."""
        self.server.stop(grace_s=2)
