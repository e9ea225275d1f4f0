"""Kill faults: signal a server's whole process group, or only its engine-core process.

Each injector has ``inject`` and a guaranteed ``cleanup`` (idempotent), and records what it did
(``record``) for the report.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import psutil

from leasekit.chaos.faults._common import FaultError, stamp, wait_for
from leasekit.cluster.server import VllmServer

#: vLLM names its engine-core process with setproctitle: the full title is in the cmdline, the
#: kernel's ``comm`` (psutil ``name()``) keeps only the first 15 bytes (``VLLM::EngineCor``).
ENGINE_CORE_TITLE = "VLLM::EngineCore"
KillScope = Literal["group", "engine_core"]
SCOPES = ("group", "engine_core")


def find_engine_core_pids(pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` whose process name or title shows ``VLLM::EngineCore``.

    Matches ``name()`` starting with the 15-byte truncation ``VLLM::EngineCor``, or ``argv[0]``
    (where setproctitle writes the title) starting with the full title (``VLLM::EngineCore_DP0``
    too). Only argv[0]: a shell whose script merely mentions the title is not a match.
    Vanished or unreadable processes are skipped.
    Returns a sorted list (empty if none matches).
    """
    found = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            name = proc.name()
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        if name.startswith(ENGINE_CORE_TITLE[:15]) or (cmdline and cmdline[0].startswith(ENGINE_CORE_TITLE)):
            found.append(pid)
    return sorted(found)


@dataclass
class KillFault:
    """Send ``sig`` to a server: its whole process group (``scope="group"``: API server, engine
    core, workers) or only its engine-core process(es) (``scope="engine_core"``).

    After a SIGKILL it verifies that no signalled process survived; ``record`` (filled in place:
    callers may hold the dict) says which pids were signalled, when (``injected_monotonic_s``:
    ``time.monotonic()`` of this process, ``injected_wall_s``: ``time.time()``) and which
    survived (``survivors``).

    Raises:
        ValueError: ``scope`` is not ``"group"`` or ``"engine_core"``.
    """

    server: VllmServer
    sig: signal.Signals = signal.SIGKILL
    scope: KillScope = "group"
    record: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        self.sig = signal.Signals(self.sig)

    def inject(self) -> None:
        """Signal the target now.

        Raises:
            RuntimeError: the server was not running.
            FaultError: ``scope="engine_core"`` and no process of the server is the engine core.
        """
        if not self.server.alive():
            raise RuntimeError(f"cannot kill {self.server.spec.name}: it is not running")
        if getattr(self.server, "host", None) is not None:  # a server on another host: signalled there
            self._inject_on_host()
            return
        pids = self.server.pids()
        targets = pids if self.scope == "group" else find_engine_core_pids(pids)
        if not targets:
            raise FaultError(
                f"cannot kill {self.server.spec.name}'s engine core: none of its processes {pids} "
                f"has {ENGINE_CORE_TITLE!r} in its name or command line"
            )
        # Recorded before the signal goes out, so an interrupted run still knows the fault happened.
        self.record.clear()
        self.record.update({
            "kind": "kill",
            "scope": self.scope,
            "target": self.server.spec.name,
            "signal": self.sig.name,
            "pids": targets,
        })
        stamp(self.record, "injected")
        if self.scope == "group":
            self.record["pids"] = self.server.kill(self.sig) or targets
        else:
            self.record["engine_core_pids"] = targets
            for pid in targets:
                try:
                    os.kill(pid, self.sig)
                except ProcessLookupError:
                    pass
        survivors: list[int] = []
        if self.sig == signal.SIGKILL:
            procs = []
            for pid in self.record["pids"]:
                try:
                    procs.append(psutil.Process(pid))
                except psutil.NoSuchProcess:
                    pass
            # a killed process may stay a zombie until its parent reaps it: zombies count as dead
            wait_for(lambda: not any(_running(p) for p in procs), timeout_s=5.0)
            survivors = sorted(p.pid for p in procs if _running(p))
        self.record["survivors"] = survivors

    def _inject_on_host(self) -> None:
        """:meth:`inject` for a server on another host: the group (or only the engine core, found by
        its title there) is signalled on that host; survivors are the group's live pids there."""
        self.record.clear()
        self.record.update({"kind": "kill", "scope": self.scope, "target": self.server.spec.name,
                            "signal": self.sig.name, "host": self.server.host.name, "pids": self.server.pids()})
        stamp(self.record, "injected")
        if self.scope == "group":
            self.record["pids"] = self.server.kill(self.sig) or self.record["pids"]
            survivors = self.server.pids() if self.sig == signal.SIGKILL else []
        else:
            self.record["engine_core_pids"] = self.record["pids"] = signal_engine_core(self.server, self.sig)
            if self.sig == signal.SIGKILL:
                wait_for(lambda: not set(self.record["pids"]) & set(self.server.pids()), timeout_s=5.0)
            survivors = sorted(set(self.record["pids"]) & set(self.server.pids())) if self.sig == signal.SIGKILL else []
        self.record["survivors"] = survivors

    def cleanup(self) -> None:
        """Make sure nothing of the group is left (a killed server stays down); idempotent."""
        self.server.stop(grace_s=2)


def signal_engine_core(server, sig: int) -> list[int]:
    """Send ``sig`` to the engine-core process(es) of a server on another host (a
    :class:`~leasekit.cluster.remote.RemoteVllmServer`, signalled through its ``host``; found there by
    the process title ``VLLM::EngineCore`` in argv[0] or comm); returns their pids.

    Raises:
        FaultError: the server is not running, or no process of its group is the engine core.
    """
    if server.proc is None:
        raise FaultError(f"server {server.spec.name} is not running")
    host = server.host
    pids = host.group_pids(int(server.proc.pid))
    script = 'for p; do printf "%s %s|%s\\n" "$p" "$(cat /proc/$p/comm 2>/dev/null)" "$(tr "\\0" " " < /proc/$p/cmdline 2>/dev/null | cut -c1-64)"; done'
    _, out, _ = host.run(["sh", "-c", script, "sh", *map(str, pids)], timeout_s=30)
    found = []
    for line in out.splitlines():
        pid, _, rest = line.partition(" ")
        comm, _, argv0 = rest.partition("|")
        if pid.isdigit() and (comm.startswith(ENGINE_CORE_TITLE[:15]) or argv0.startswith(ENGINE_CORE_TITLE)):
            found.append(int(pid))
    if not found:
        raise FaultError(f"cannot signal {server.spec.name}'s engine core on host {host.name}: none of its processes "
                         f"{pids} has {ENGINE_CORE_TITLE!r} in its name or command line")
    host.check(["kill", f"-{signal.Signals(sig).name.removeprefix('SIG')}", *map(str, found)])
    return sorted(found)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def plan_commands(target: str, signal_name: str = "SIGKILL", scope: KillScope = "group") -> list[dict]:
    """What :class:`KillFault` would do to the server ``target`` (``prefill``/``decode``), as plan
    steps ``{"argv": [...], "what": "..."}`` (nothing is run). Pids unknown before the run are
    placeholders such as ``<pgid of decode>``.

    Raises:
        ValueError: ``scope`` not ``group``/``engine_core``, or an unknown signal name.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    sig = signal.Signals[signal_name].name.removeprefix("SIG")
    if scope == "engine_core":
        return [{"argv": ["kill", f"-{sig}", f"<pid of the {ENGINE_CORE_TITLE} process(es) of {target}>"],
                 "what": f"{signal_name} to {target}'s engine core only (found by its process title)"}]
    steps = [{"argv": ["kill", f"-{sig}", "--", f"-<pgid of {target}>"],
              "what": f"{signal_name} to {target}'s whole process group (API server, engine core, workers)"}]
    if sig == "KILL":
        steps.append({"argv": ["kill", "-KILL", f"<each pid left in the {target} group or descended from its leader>"],
                      "what": "SIGKILL stragglers by ancestry, then check that none survived (up to 5 s)"})
    return steps
