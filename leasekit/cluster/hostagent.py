"""The host side of :mod:`leasekit.cluster.hosts`: a stdlib-only script the controller copies into a
host's run directory and runs there with that host's own Python (``python agent.py COMMAND ...``).

It keeps every process-group and cleanup rule in one place for both :class:`~leasekit.cluster.localhost.LocalHost`
and :class:`~leasekit.cluster.sshhost.SshHost`:

- ``serve``: a session kept open by the controller that answers one JSON request per line
  (``{"op": "spawn" | "pids" | "signal" | "pin" | "register" | "stop_watchdog", ...}``), so an operation costs one
  round trip instead of a new SSH command. ``spawn`` starts ``argv`` as a new session (``setsid``),
  so its pid is also its process-group id; stdout/stderr go to a log file on the host, stdin is
  ``/dev/null``, so the group outlives the SSH session that started it. The pgid is appended to the
  run's ``manifest`` and written to ``pids/<name>.pid``; the group's environment carries
  ``LEASEKIT_HOST_RUN=<run dir>``. ``pin`` sets the affinity of every thread (``taskset -a -p -c``).
- ``watchdog``: a detached loop that ends the run (``cleanup``) once the ``heartbeat`` file the
  controller rewrites every few seconds has not changed for ``--stale-s`` seconds (measured on this
  host's monotonic clock, so clock offsets between hosts do not matter): a lost SSH connection or a
  controller killed with SIGKILL/SIGTERM leaves nothing running.
- ``cleanup``: SIGKILL every registered group, remove registered files, dirs and cgroups, then the run
  directory; prints a JSON summary and exits 1 if a registered process survived.

Manifest lines are ``<kind> <value>`` with kind ``group`` (a pgid), ``file``, ``dir`` or ``cgroup`` (a path).
A group is signalled only while one of its processes carries this run's marker, so a pgid reused by an
unrelated process after the group ended is never touched. Zombies count as gone: some init processes
(containers) never reap orphans.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

MARKER = "LEASEKIT_HOST_RUN"
KINDS = ("group", "file", "dir", "cgroup")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, pgid) of ``pid`` from ``/proc/<pid>/stat``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[2])


def group_pids(pgid: int) -> list[int]:
    """Live pids (zombies excluded) whose process group is ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[1] == pgid and stat[0] not in ("Z", "X"):
                found.append(int(entry))
    return sorted(found)


def _marked(pid: int, run_dir: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return f"{MARKER}={run_dir}".encode() in handle.read().split(b"\0")
    except OSError:
        return False


def signal_group(pgid: int, sig: int, run_dir: str) -> bool:
    """``killpg(pgid, sig)`` if a live process of the group carries this run's marker; False otherwise."""
    if pgid <= 1 or not any(_marked(pid, run_dir) for pid in group_pids(pgid)):
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def manifest(run_dir: str) -> list[tuple[str, str]]:
    """The run's registered things, in registration order (missing manifest: none)."""
    try:
        with open(os.path.join(run_dir, "manifest")) as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return []
    return [tuple(line.split(" ", 1)) for line in lines if " " in line and line.split(" ", 1)[0] in KINDS]


def register(run_dir: str, kind: str, value: str) -> None:
    """Append ``kind value`` to the manifest (O_APPEND: concurrent writers do not interleave)."""
    if kind not in KINDS or "\n" in value:
        raise ValueError(f"register: kind must be one of {KINDS} and the value one line, got {kind!r} {value!r}")
    with open(os.path.join(run_dir, "manifest"), "a") as handle:
        handle.write(f"{kind} {value}\n")


def spawn(run_dir: str, name: str, log: str, cwd: str | None, argv: list[str],
          env: dict[str, str]) -> tuple[int, subprocess.Popen]:
    """Start ``argv`` detached in a new session with ``env`` added to this environment; returns
    its pid (= pgid) and the Popen (for reaping)."""
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
    env = {**os.environ, **{str(k): str(v) for k, v in env.items()}, MARKER: run_dir}
    os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
    os.makedirs(os.path.join(run_dir, "pids"), exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                cwd=cwd, env=env, start_new_session=True)
    register(run_dir, "group", str(proc.pid))
    with open(os.path.join(run_dir, "pids", f"{name}.pid"), "w") as handle:
        handle.write(f"{proc.pid}\n")
    return proc.pid, proc


def _watchdog_pid(run_dir: str) -> int | None:
    """The pid of the run's live watchdog, or None."""
    try:
        with open(os.path.join(run_dir, "watchdog.pid")) as handle:
            pid = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    alive = pid != os.getpid() and _marked(pid, run_dir) and (_stat(pid) or ("Z",))[0] not in ("Z", "X")
    return pid if alive else None


def _watchdog_alive(run_dir: str) -> bool:
    return _watchdog_pid(run_dir) is not None


def stop_watchdog(run_dir: str) -> int | None:
    """SIGKILL the run's watchdog and wait (up to 5 s) until it is dead; returns its pid, or None
    if there was none to stop."""
    pid = _watchdog_pid(run_dir)
    if pid is None:
        return None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (_stat(pid) or ("Z",))[0] not in ("Z", "X"):
        time.sleep(0.01)
    return pid


def cleanup(run_dir: str, kill_watchdog: bool) -> dict:
    """End the run on this host: SIGKILL its groups, remove what it registered and the run directory."""
    summary: dict = {"killed": [], "removed": [], "left": [], "errors": []}
    if kill_watchdog:
        stop_watchdog(run_dir)
    entries = manifest(run_dir)
    groups = [int(value) for kind, value in entries if kind == "group"]
    for pgid in groups:
        pids = group_pids(pgid)
        if signal_group(pgid, signal.SIGKILL, run_dir):
            summary["killed"].extend(pids)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_still_ours(g, run_dir) for g in groups):
        time.sleep(0.05)
    summary["left"] = sorted(pid for g in groups for pid in group_pids(g) if _marked(pid, run_dir))
    for kind, value in reversed(entries):
        try:
            if kind == "file" and os.path.lexists(value):
                os.remove(value)
            elif kind == "dir" and os.path.isdir(value):
                shutil.rmtree(value)
            elif kind == "cgroup" and os.path.isdir(value):
                _remove_cgroup(value)
            else:
                continue
            summary["removed"].append(value)
        except OSError as exc:
            summary["errors"].append(f"{kind} {value}: {exc}")
    shutil.rmtree(run_dir, ignore_errors=True)
    if os.path.exists(run_dir):
        summary["errors"].append(f"run dir {run_dir} still present")
    else:
        summary["removed"].append(run_dir)
    return summary


def _still_ours(pgid: int, run_dir: str) -> bool:
    return any(_marked(pid, run_dir) for pid in group_pids(pgid))


def _remove_cgroup(path: str) -> None:
    with open(os.path.join(path, "cgroup.procs")) as handle:
        for pid in handle.read().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    while True:
        try:
            os.rmdir(path)
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def watchdog(run_dir: str, stale_s: float, interval_s: float) -> None:
    """Loop until the heartbeat file stops changing for ``stale_s`` seconds (or vanishes), then clean up."""
    path = os.path.join(run_dir, "heartbeat")
    last, changed_at = None, time.monotonic()
    while os.path.isdir(run_dir):
        try:
            with open(path, "rb") as handle:
                beat = handle.read()
        except OSError:
            beat = None
        now = time.monotonic()
        if beat is not None and beat != last:
            last, changed_at = beat, now
        if beat is None or now - changed_at > stale_s:
            summary = cleanup(run_dir, kill_watchdog=False)
            print(json.dumps({"watchdog": "heartbeat stale" if beat else "heartbeat gone", **summary}), flush=True)
            return
        time.sleep(interval_s)


def _start_watchdog(run_dir: str, stale_s: float, interval_s: float) -> int:
    env = dict(os.environ, **{MARKER: run_dir})
    with open(os.path.join(run_dir, "watchdog.log"), "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "watchdog", run_dir, "--stale-s", str(stale_s),
             "--interval-s", str(interval_s)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    with open(os.path.join(run_dir, "watchdog.pid"), "w") as handle:
        handle.write(f"{proc.pid}\n")
    return proc.pid


def pin(pids: list[int], cores: list[int]) -> int:
    """Set the CPU affinity of every thread of ``pids`` to ``cores`` (as ``taskset -a -p -c``);
    returns the processes pinned (those that vanished meanwhile are skipped)."""
    pinned = 0
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), cores)
            pinned += 1
        except (FileNotFoundError, ProcessLookupError):
            continue
    return pinned


class Agent:
    """The ``serve`` loop's state: children started here are reaped here while it lives."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.children: list[subprocess.Popen] = []

    def handle(self, request: dict):
        """Answer one request ``{"op": ..., ...}``; raises on bad requests."""
        self.children = [child for child in self.children if child.poll() is None]  # reap
        op = request["op"]
        if op == "spawn":
            pid, child = spawn(self.run_dir, request["name"], request["log"], request.get("cwd"),
                               request["argv"], request.get("env") or {})
            self.children.append(child)
            return pid
        if op == "pids":
            return group_pids(int(request["pgid"]))
        if op == "signal":
            return signal_group(int(request["pgid"]), int(request["sig"]), self.run_dir)
        if op == "pin":
            return pin(group_pids(int(request["pgid"])), [int(c) for c in request["cores"]])
        if op == "stop_watchdog":
            return stop_watchdog(self.run_dir)
        if op == "register":
            register(self.run_dir, request["kind"], request["value"])
            return None
        raise ValueError(f"unknown op {op!r}")


def serve(run_dir: str, stale_s: float | None, interval_s: float) -> None:
    """Start the run's watchdog unless it runs (with ``stale_s``), then answer JSON requests, one per
    input line, with ``{"ok": result}`` or ``{"error": message}`` lines until input ends (the
    controller's session closed); groups started here live on."""
    if stale_s is not None and not _watchdog_alive(run_dir):
        _start_watchdog(run_dir, stale_s, interval_s)
    agent = Agent(run_dir)
    print(json.dumps({"ok": "ready"}), flush=True)
    for line in iter(sys.stdin.readline, ""):
        try:
            answer = {"ok": agent.handle(json.loads(line))}
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the controller
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hostagent")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve")
    p.add_argument("run_dir")
    p.add_argument("--stale-s", type=float)
    p.add_argument("--interval-s", type=float, default=0.5)
    p = sub.add_parser("watchdog")
    p.add_argument("run_dir")
    p.add_argument("--stale-s", type=float, required=True)
    p.add_argument("--interval-s", type=float, default=0.5)
    p = sub.add_parser("cleanup")
    p.add_argument("run_dir")
    p.add_argument("--kill-watchdog", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.run_dir, args.stale_s, args.interval_s)
    elif args.command == "watchdog":
        watchdog(args.run_dir, args.stale_s, args.interval_s)
    else:
        summary = cleanup(args.run_dir, args.kill_watchdog)
        print(json.dumps(summary))
        return 1 if summary["left"] else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
