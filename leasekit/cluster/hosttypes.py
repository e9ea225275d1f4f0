"""Types shared by the host modules (:mod:`leasekit.cluster.hosts`, :mod:`~leasekit.cluster.localhost`,
:mod:`~leasekit.cluster.sshhost`): errors, clock readings, teardown reports and the agent session.
Import them from :mod:`leasekit.cluster.hosts`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence


class HostError(RuntimeError):
    """A host operation failed; the message names the host (and its address for SSH)."""


class HostUnreachable(HostError):
    """The host could not be reached or logged into; the message has the address and the fix."""


class HostTimeout(HostError):
    """A command on the host ran past its timeout (it is ended there too)."""


class PreflightError(HostError):
    """The host lacks what the run needs; the message lists each problem with its fix."""


class HostTeardownError(HostError):
    """Teardown could not reach the host or something it registered survived."""


@dataclass(frozen=True)
class ClockReading:
    """The host's ``time.perf_counter()`` (seconds) estimated for the instant ``local_s`` (this
    process's ``perf_counter`` when the read returned), within ``± uncertainty_s`` (half the round
    trip of the best of a few reads; 0 for this machine)."""

    value_s: float
    uncertainty_s: float
    local_s: float

    @property
    def offset_s(self) -> float:
        """Host clock minus this process's clock, seconds (± ``uncertainty_s``)."""
        return self.value_s - self.local_s


@dataclass
class TeardownReport:
    """What :meth:`Host.teardown` did on one host: pids killed, paths removed (run dir last)."""

    host: str
    killed: list[int] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


class AgentSession:
    """A running ``agent.py serve`` on a host: ``send(bytes)`` one request line, ``readline()`` one
    answer line (``b""`` once it ended), ``close()``; made by ``Host._open_agent``. Waits for the
    agent's ``ready`` line. Raises HostError: the agent did not start (its stderr in the message)."""

    def __init__(self, host, send, readline, close, stderr):
        self.send, self.readline, self.close = send, readline, close
        first = readline()
        if json.loads(first or b"{}").get("ok") != "ready":
            close()
            raise HostError(f"host {host.name} ({host.where}): the host agent did not start with {host.python}: "
                            f"{first!r} {stderr()[-1000:]!r}")


def check_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` as a list of strings. Raises ValueError: empty, or not all strings."""
    if isinstance(argv, (str, bytes)) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv must be a non-empty list of strings (no shell string), got {argv!r}")
    return list(argv)
