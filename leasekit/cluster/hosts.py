"""Control of a host (this machine or another over SSH), Jepsen-style: run commands, start detached
process groups, signal/pin them, move files, read the host's clock, and tear it all down.

:class:`Host` is the interface and shared logic; :class:`~leasekit.cluster.localhost.LocalHost` is this
machine, :class:`~leasekit.cluster.sshhost.SshHost` another host over SSH with paramiko (synchronous,
fits the threaded harness with no event loop, SFTP built in; asyncssh needs an event loop, fabric only
adds a task layer over paramiko that is not needed here). Both keep a *run directory*
on the host (``<workdir>/leasekit-<run id>``) with the host agent (:mod:`leasekit.cluster.hostagent`,
run by the host's own Python), a ``manifest`` of what the run registered there (process groups,
files, dirs, cgroups), pid files, logs, and a ``heartbeat`` file rewritten every ``heartbeat_s`` s.

Teardown survives the controller's loss: :meth:`Host.teardown` (from ``finally``, or the context
manager: Ctrl-C runs it) reconnects if the connection dropped and runs the agent's ``cleanup``. If the
controller dies (SIGTERM with no handler, SIGKILL) or the host stays unreachable, the host's watchdog
runs the same ``cleanup`` once the heartbeat has not changed for ``stale_s`` seconds. So a fault that
cuts the *control* path for longer than ``stale_s`` ends that host's processes: keep the SSH port out
of partitions, or raise ``stale_s`` above the longest partition.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import threading
import uuid
from pathlib import Path, PurePosixPath
from typing import Sequence

from leasekit.cluster.hostagent import KINDS
from leasekit.cluster.hosttypes import (  # noqa: F401 - re-exported: the host API is imported from here
    AgentSession,
    ClockReading,
    HostError,
    HostTeardownError,
    HostTimeout,
    HostUnreachable,
    PreflightError,
    TeardownReport,
    check_argv,
)

__all__ = ["AgentSession", "ClockReading", "Host", "HostError", "HostTeardownError", "HostTimeout", "HostUnreachable",
           "PreflightError", "TeardownReport", "check_argv"]

AGENT_SOURCE = Path(__file__).with_name("hostagent.py")
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$")
TOOL_PACKAGES = {"nft": "nftables", "ip": "iproute2", "tc": "iproute2", "unshare": "util-linux", "taskset": "util-linux",
                 "setsid": "util-linux", "faketime": "faketime", "timeout": "coreutils", "sshd": "openssh-server"}
"""Debian package of each tool :meth:`Host.preflight` knows (others get a generic fix)."""


class Host:
    """One host the run controls. Subclasses provide :meth:`run`, :meth:`_put`, :meth:`_get`,
    :meth:`fetch` and :meth:`perf_counter`; everything else goes through the host agent.

    Args:
        name: the host's name in the pair file (``prefill``, ``gpu-b``), used in every message.
        python: the host's Python (runs the agent; the one with vLLM for servers).
        workdir: where the run directory is made on the host.
        run_name: the run directory's name in ``workdir`` (default ``leasekit-<12 hex digits>``).
        heartbeat_s / stale_s: heartbeat period and the watchdog's staleness limit, seconds
            (``stale_s`` must be at least 2 heartbeats).

    Raises ValueError: a bad name, ``heartbeat_s <= 0`` or ``stale_s < 2 * heartbeat_s``.
    """

    where = "this machine"  # where the host is reached, for messages (``root@10.237.0.2:22`` for SSH)

    def __init__(self, name: str, *, python: str = "python3", workdir: str = "/tmp", run_name: str | None = None,
                 heartbeat_s: float = 2.0, stale_s: float = 60.0):
        if not name or not all(c.isalnum() or c in "-_." for c in name):
            raise ValueError(f"host name must be non-empty [A-Za-z0-9._-], got {name!r}")
        if not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0 seconds, got {heartbeat_s!r}")
        if not stale_s >= 2 * heartbeat_s:
            raise ValueError(f"stale_s ({stale_s}) must be >= 2 * heartbeat_s ({heartbeat_s})")
        self.name, self.python, self.workdir = name, python, workdir
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        run_name = run_name or f"leasekit-{uuid.uuid4().hex[:12]}"
        if not _NAME_RE.match(run_name):
            raise ValueError(f"run_name must match {_NAME_RE.pattern}, got {run_name!r}")
        self.run_dir = str(PurePosixPath(workdir) / run_name)
        self._ready = self.closed = False
        self._session: AgentSession | None = None
        self._groups: set[int] = set()
        self._stop = threading.Event()
        self._beat_thread: threading.Thread | None = None
        self._lock = threading.RLock()
        self.heartbeat_errors = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.where!r})"

    def name_run(self, run_name: str) -> bool:
        """Name the run directory on the host ``<workdir>/<run_name>`` if nothing was made there yet
        (commands run before, such as host checks, make nothing); returns whether the name is now
        ``run_name``. Raises ValueError: ``run_name`` is not ``[A-Za-z0-9._-]``."""
        if not _NAME_RE.match(run_name):
            raise ValueError(f"run_name must match {_NAME_RE.pattern}, got {run_name!r}")
        with self._lock:
            if not self._ready and not self.closed:
                self.run_dir = str(PurePosixPath(self.workdir) / run_name)
            return PurePosixPath(self.run_dir).name == run_name

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:  # Ctrl-C and errors alike end in teardown
        self.teardown()

    # -- primitives (subclasses) -------------------------------------------------------------
    def run(self, argv: Sequence[str], timeout_s: float = 30.0, input: str | bytes | None = None) -> tuple[int, str, str]:
        """Run ``argv`` on the host; returns ``(exit code, stdout, stderr)`` (127: no such program).
        Raises ValueError: bad ``argv``; HostTimeout: past ``timeout_s`` s; HostUnreachable: no connection."""
        raise NotImplementedError

    def _put(self, path: str, data: bytes) -> None:  # write a whole file on the host
        raise NotImplementedError

    def _get(self, path: str) -> bytes:  # read a whole file on the host
        raise NotImplementedError

    def fetch(self, remote: str, local: str | Path) -> Path:
        """Copy file ``remote`` (relative: inside the run dir) from the host to ``local``; returns it."""
        raise NotImplementedError

    def perf_counter(self) -> ClockReading:
        """The host's ``time.perf_counter()`` now (see :class:`ClockReading`)."""
        raise NotImplementedError

    def _open_agent(self) -> "AgentSession":  # run agent_command() on the host, wired to this process
        raise NotImplementedError

    def agent_command(self) -> list[str]:
        """``python agent.py serve RUN_DIR`` with the watchdog's limits (it starts the watchdog)."""
        return [self.python, "-u", self.path("agent.py"), "serve", self.run_dir, "--stale-s", f"{self.stale_s:g}",
                "--interval-s", f"{min(0.5, self.stale_s / 4):g}"]

    def _close(self) -> None:
        """Release the agent session and connections."""
        with self._lock:
            if self._session is not None:
                self._session.close()
                self._session = None

    # -- shared operations -------------------------------------------------------------------
    def path(self, path: str) -> str:
        """``path`` on the host: relative paths are inside the run directory."""
        return str(PurePosixPath(self.run_dir) / path)

    def check(self, argv: Sequence[str], timeout_s: float = 30.0, input: str | bytes | None = None) -> str:
        """:meth:`run`, returning stdout. Raises HostError: non-zero exit (with its stderr)."""
        rc, out, err = self.run(argv, timeout_s, input)
        if rc != 0:
            raise HostError(f"host {self.name} ({self.where}): {shlex.join(argv)} exited {rc}: {err.strip()[-2000:]}")
        return out

    def which(self, tool: str) -> str | None:
        """Path of ``tool`` on the host's PATH (as the run's commands see it), or None."""
        rc, out, _ = self.run(["sh", "-c", 'command -v "$1"', "sh", tool], timeout_s=15)
        return out.strip() or None if rc == 0 else None

    def write_file(self, path: str, data: str | bytes, *, register: bool = True) -> str:
        """Write ``data`` to ``path`` on the host (relative: in the run dir; absolute paths outside it
        are registered for removal at teardown unless ``register=False``); returns the host path.
        Raises HostError: it cannot be written there."""
        self._ensure_ready()
        target = self.path(path)
        try:
            self._put(target, data.encode() if isinstance(data, str) else data)
        except OSError as exc:
            raise HostError(f"host {self.name} ({self.where}): cannot write {target}: {exc}") from exc
        if register and not target.startswith(self.run_dir + "/"):
            self.register("file", target)
        return target

    def read_file(self, path: str) -> bytes:
        """Contents of ``path`` on the host (relative: in the run dir). Raises HostError: unreadable."""
        try:
            return self._get(self.path(path))
        except OSError as exc:
            raise HostError(f"host {self.name} ({self.where}): cannot read {self.path(path)}: {exc}") from exc

    def register(self, kind: str, value: str) -> None:
        """Record a ``group`` (pgid), ``file``, ``dir`` or ``cgroup`` on the host's manifest, so that
        teardown (or the watchdog) removes it. Raises ValueError: unknown kind."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self._call("register", kind=kind, value=value)

    def spawn(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
              log_path: str | None = None, name: str | None = None) -> int:
        """Start ``argv`` on the host as a detached process group (``setsid``: it outlives this
        connection); returns its pgid. ``env`` is added to the host's own environment; stdout and
        stderr go to ``log_path`` on the host (default ``logs/<name>.log`` in the run dir); the pid
        is written to ``pids/<name>.pid`` there.

        Raises ValueError: bad ``argv``, ``name`` or ``env``; HostError: it could not be started."""
        argv = check_argv(argv)
        name = name or f"{os.path.basename(argv[0])}-{len(self._groups)}"
        if not _NAME_RE.match(name):
            raise ValueError(f"name must match {_NAME_RE.pattern} (it names the pid and log files), got {name!r}")
        if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError(f"env must map str to str, got {env!r}")
        pgid = int(self._call("spawn", argv=argv, env=env or {}, cwd=cwd, name=name,
                              log=self.path(log_path or f"logs/{name}.log")))
        self._groups.add(pgid)
        return pgid

    def _own(self, pgid: int) -> int:
        if pgid not in self._groups:
            raise ValueError(f"pgid {pgid!r} was not spawned by this run on host {self.name} (have {sorted(self._groups)})")
        return pgid

    def signal_group(self, pgid: int, sig: int) -> bool:
        """Send ``sig`` (SIGKILL, SIGSTOP, SIGCONT, SIGTERM...) to a group this run spawned; False if it
        is gone. Raises ValueError: not a group of this run."""
        return bool(self._call("signal", pgid=self._own(pgid), sig=int(sig)))

    def group_pids(self, pgid: int) -> list[int]:
        """Live pids (zombies excluded) of process group ``pgid`` on the host."""
        return [int(p) for p in self._call("pids", pgid=int(pgid))]

    def alive(self, pgid: int) -> bool:
        """Whether any process of group ``pgid`` is still running."""
        return bool(self.group_pids(pgid))

    def pin(self, pgid: int, cores: Sequence[int]) -> int:
        """Set the CPU affinity of every thread of every process of a group of this run to ``cores``
        (what ``taskset -a -p -c CORES PID`` does); returns the processes pinned.

        Raises ValueError: no cores or a negative one; HostError: a core the host does not have."""
        if not cores or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in cores):
            raise ValueError(f"cores must be a non-empty list of CPU numbers >= 0, got {cores!r}")
        return int(self._call("pin", pgid=self._own(pgid), cores=list(cores)))

    def preflight(self, tools: Sequence[str], *, python_modules: Sequence[str] = (), root: bool = True) -> None:
        """Check before the run that the host has every tool in ``tools`` on PATH, a Python
        (``self.python``) that imports ``python_modules``, and (``root``) uid 0.

        Raises:
            PreflightError: every problem found, each with its fix
                (``host gpu-b lacks nft; fix: apt-get install nftables on gpu-b``).
        """
        problems = []
        # one command for every tool and the uid: `command -v` as the run's commands will see PATH
        script = 'id -u; for t; do command -v "$t" >/dev/null 2>&1 || echo "missing $t"; done'
        rc, out, err = self.run(["sh", "-c", script, "sh", *tools], timeout_s=30)
        lines = out.splitlines()
        for line in lines[1:]:
            tool = line.removeprefix("missing ")
            package = TOOL_PACKAGES.get(tool) or TOOL_PACKAGES.get(os.path.basename(tool))
            fix = f"apt-get install {package} on {self.name}" if package else f"install {tool} on {self.name} (on the PATH of its run)"
            problems.append(f"host {self.name} lacks {tool}; fix: {fix}")
        if root and (rc != 0 or not lines or lines[0].strip() != "0"):
            problems.append(f"host {self.name}: the run is not root there (uid {lines[0] if lines else '?'}); "
                            f"fix: log in as root (hosts.{self.name}.user = \"root\")")
        if python_modules:
            check = ("import importlib, sys\nfor m in sys.argv[1:]:\n    try:\n        importlib.import_module(m)\n"
                     "    except Exception as e:\n        print(m, type(e).__name__, e)\n")
            rc, out, err = self.run([self.python, "-c", check, *python_modules], timeout_s=120)
            failures = out.splitlines() if rc == 0 else [f"{m} ({err.strip()[-300:] or f'exit {rc}'})" for m in python_modules]
            for failure in failures:
                module, _, why = failure.partition(" ")
                problems.append(f"host {self.name}: {self.python} cannot import {module} ({why}); fix: install {module} "
                                f"into {self.python} on {self.name}, or point hosts.{self.name}.python at a Python that has it")
        if problems:
            raise PreflightError("\n".join(problems))

    # -- run directory, heartbeat, teardown ------------------------------------------------------
    def _call(self, op: str, **args):
        """One request to the host agent's ``serve`` session (opened on first use, reopened once if
        it died, except for ``spawn`` which is not repeated); returns its result.

        Raises HostError: the agent refused the request; HostUnreachable: the session died."""
        self._ensure_ready()
        request = (json.dumps({"op": op, **args}) + "\n").encode()
        with self._lock:
            for attempt in (1, 2):
                try:
                    if self._session is None:
                        self._session = self._open_agent()
                    self._session.send(request)
                    line = self._session.readline()
                    if not line:
                        raise EOFError("agent session closed")
                    break
                except (EOFError, OSError) as exc:
                    self._close()
                    if attempt == 2 or op == "spawn":
                        raise HostUnreachable(f"host {self.name} ({self.where}): agent session lost during {op}: {exc!r}") from exc
        answer = json.loads(line)
        if "error" in answer:
            raise HostError(f"host {self.name} ({self.where}): {op} failed: {answer['error']}")
        return answer["ok"]

    def _ensure_ready(self) -> None:
        """Create the run dir with the agent, manifest and heartbeat, start the watchdog and heartbeat."""
        with self._lock:
            if self._ready:
                return
            if self.closed:
                raise HostError(f"host {self.name} ({self.where}) was torn down; fix: make a new host object")
            self.check(["mkdir", "-p", "-m", "0700", self.run_dir])
            self._ready = True  # from here on teardown has something to undo
            self._put(self.path("agent.py"), AGENT_SOURCE.read_bytes())
            self._put(self.path("manifest"), b"")
            self._put(self.path("heartbeat"), b"0")
            self._session = self._open_agent()  # starts the watchdog
            self._beat_thread = threading.Thread(target=self._beat, name=f"heartbeat-{self.name}", daemon=True)
            self._beat_thread.start()

    def _beat(self) -> None:
        count = 0
        while not self._stop.wait(self.heartbeat_s):
            count += 1
            try:
                self._put(self.path("heartbeat"), str(count).encode())
            except Exception:  # noqa: BLE001 - a lost host: the watchdog takes over
                self.heartbeat_errors += 1

    def teardown(self) -> TeardownReport:
        """Kill every process group and remove every file, dir and cgroup this run registered on the
        host, then the run dir; idempotent, and final (the host is ``closed``: no new run dir). Reconnects
        if the connection was lost. The watchdog is stopped first, while heartbeats still go, so that
        it never cleans up alongside.

        Raises:
            HostTeardownError: the host stayed unreachable (its watchdog then cleans up ``stale_s``
                seconds after the last heartbeat), or a registered process survived SIGKILL.
        """
        report = TeardownReport(self.name)
        try:
            if self._ready:
                try:
                    if self.run(["test", "-d", self.run_dir], timeout_s=15)[0] != 0:
                        self._ready = False  # the watchdog already cleaned up
                        return report
                    self._call("stop_watchdog")
                    self._stop_beating()
                    rc, out, err = self.run([self.python, self.path("agent.py"), "cleanup", self.run_dir, "--kill-watchdog"],
                                            timeout_s=60)
                except HostError as exc:
                    raise HostTeardownError(
                        f"host {self.name} ({self.where}): teardown failed ({exc}); its watchdog ends the run's "
                        f"process groups and removes {self.run_dir} {self.stale_s:g} s after the last heartbeat"
                    ) from exc
                try:
                    summary = json.loads(out.strip().splitlines()[-1])
                except (ValueError, IndexError):
                    raise HostTeardownError(f"host {self.name} ({self.where}): cleanup exited {rc}: {err.strip()[-2000:]}")
                report.killed, report.removed = summary["killed"], summary["removed"]
                if summary["left"] or summary["errors"]:
                    raise HostTeardownError(f"host {self.name} ({self.where}): teardown left pids {summary['left']} "
                                            f"and errors {summary['errors']}")
                self._ready = False
            return report
        finally:
            self._stop_beating()
            self.closed = True
            self._groups.clear()
            self._close()

    def _stop_beating(self) -> None:
        self._stop.set()
        if self._beat_thread is not None:
            self._beat_thread.join(timeout=self.heartbeat_s + 30)
            self._beat_thread = None
