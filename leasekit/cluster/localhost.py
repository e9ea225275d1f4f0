"""This machine as a :class:`~leasekit.cluster.hosts.Host`: commands through ``subprocess``, process
groups through :mod:`leasekit.cluster.procs`; the run directory, agent, manifest, heartbeat and
watchdog work exactly as on an SSH host, so a run can mix both."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from leasekit.cluster import procs
from leasekit.cluster.hosts import AgentSession, ClockReading, Host, HostTimeout, check_argv


class LocalHost(Host):
    """This machine: commands through ``subprocess``, groups through :mod:`leasekit.cluster.procs`;
    spawned groups, pid files, manifest and watchdog work as on an SSH host."""

    def __init__(self, name: str = "local", **kwargs):
        kwargs.setdefault("python", sys.executable)
        super().__init__(name, **kwargs)

    def run(self, argv, timeout_s=30.0, input=None):
        argv = check_argv(argv)
        data = input.encode() if isinstance(input, str) else input
        try:
            done = subprocess.run(argv, input=data, capture_output=True, timeout=timeout_s,
                                  stdin=None if data is not None else subprocess.DEVNULL)
        except FileNotFoundError as exc:
            return 127, "", f"{argv[0]}: {exc.strerror}"
        except subprocess.TimeoutExpired as exc:
            raise HostTimeout(f"host {self.name}: {shlex.join(argv)} ran past {timeout_s:g} s") from exc
        return done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")

    def _open_agent(self):
        proc = subprocess.Popen(self.agent_command(), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

        def send(data: bytes) -> None:
            proc.stdin.write(data)
            proc.stdin.flush()

        def close() -> None:
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                pipe.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

        return AgentSession(self, send, proc.stdout.readline, close, lambda: proc.stderr.read().decode(errors="replace"))

    def _put(self, path, data):
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)

    def _get(self, path):
        with open(path, "rb") as handle:
            return handle.read()

    def fetch(self, remote, local):
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.path(remote), local)
        return local

    def perf_counter(self) -> ClockReading:
        now = time.perf_counter()
        return ClockReading(now, 0.0, now)

    def group_pids(self, pgid):
        return sorted(p.pid for p in procs.group_processes(int(pgid)))

    def signal_group(self, pgid, sig):
        if not self.group_pids(self._own(pgid)):
            return False
        return procs.signal_group(pgid, signal.Signals(sig))
