"""Process-group helpers: every server runs in its own session so one ``killpg`` reaches vLLM's
API server, engine core and worker processes alike; stragglers are found by process group and by
ancestry (psutil) so nothing is left behind.
"""

from __future__ import annotations

import ctypes
import errno
import os
import random
import signal
import socket
import time
from typing import Callable

import psutil

_PR_SET_PDEATHSIG = 1


def child_preexec(cpu: int | tuple[int, ...] | None, *, die_with_parent: bool = True, idle: bool = False) -> Callable[[], None]:
    """A ``preexec_fn``: pin the child to ``cpu`` (a core or a tuple of cores, if given); with ``idle``, run it as background
    work: ``SCHED_BATCH`` at nice ``BACKGROUND_NICE`` (it never preempts a waking task and gets a
    small share against busy ones; its children inherit both, see sched(7)); and, if
    ``die_with_parent``, ask the kernel to SIGKILL it when the launching *thread* dies
    (``prctl(PR_SET_PDEATHSIG)``), so a crashed runner orphans nothing. Only ask for that from a
    long-lived thread (the main thread).

    ``SCHED_IDLE`` would be gentler still, but vLLM's engines busy-poll (NIXL progress thread, shared-
    memory queues), so on this class of machine an idle-policy spare starved and gained nothing.
    """

    def _preexec() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, _cores(cpu))
        if idle:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, 0, BACKGROUND_NICE)
        if not die_with_parent:
            return
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass

    return _preexec


def group_processes(pgid: int, root_pid: int | None = None) -> list[psutil.Process]:
    """Live processes in process group ``pgid``, plus descendants of ``root_pid`` outside it."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid:
                found[proc.pid] = proc
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    if root_pid is not None:
        try:
            root = psutil.Process(root_pid)
            found.setdefault(root.pid, root)
            for child in root.children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.Error:
            pass
    return [p for p in found.values() if _alive(p)]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def signal_group(pgid: int, sig: int) -> bool:
    """``killpg(pgid, sig)``; False if the group is already gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return False
        raise


def terminate_group(pgid: int, root_pid: int | None = None, *, grace_s: float = 10.0) -> list[int]:
    """SIGTERM the group, wait up to ``grace_s`` seconds, then SIGKILL whatever is left.

    Returns the pids that had to be SIGKILLed.
    """
    procs = group_processes(pgid, root_pid)
    if not procs:
        return []
    signal_group(pgid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    return kill_group(pgid, root_pid, extra=alive)


def kill_group(pgid: int, root_pid: int | None = None, *, extra: list[psutil.Process] | None = None) -> list[int]:
    """SIGKILL every process of the group (and ``extra``) and reap them; returns the pids killed."""
    procs = {p.pid: p for p in group_processes(pgid, root_pid)}
    for proc in extra or []:
        procs.setdefault(proc.pid, proc)
    signal_group(pgid, signal.SIGKILL)
    for proc in procs.values():
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(procs.values()), timeout=5)
    return sorted(procs)


def _thread_ids(pids: list[int]):
    """Every thread id of the live processes among ``pids``."""
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        yield from (int(tid) for tid in tids)


def _cores(cpu: int | tuple[int, ...]) -> set[int]:
    """``{cpu}`` for one core, the set of a tuple of cores."""
    return {cpu} if isinstance(cpu, int) else set(cpu)


def pin_threads(pids: list[int], cpu: int | tuple[int, ...]) -> int:
    """Set the CPU affinity of every thread of ``pids`` to ``cpu`` (a core or a tuple of cores);
    returns threads pinned."""
    cores = _cores(cpu)
    pinned = 0
    for tid in _thread_ids(pids):
        try:
            os.sched_setaffinity(tid, cores)
            pinned += 1
        except (ProcessLookupError, PermissionError, OSError):
            continue
    return pinned


BACKGROUND_NICE = 10
"""Nice value of servers started as background spares (see :func:`child_preexec`)."""


def normal_priority(pids: list[int]) -> int:
    """Move every background thread of ``pids`` (``SCHED_BATCH``/``SCHED_IDLE``) back to
    ``SCHED_OTHER`` at nice 0; returns threads changed (others are left alone)."""
    changed = 0
    for tid in _thread_ids(pids):
        try:
            if os.sched_getscheduler(tid) in (os.SCHED_BATCH, os.SCHED_IDLE):
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, 0)
                changed += 1
        except (ProcessLookupError, PermissionError, OSError):
            continue
    return changed


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low, high = (int(x) for x in handle.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host``, outside the kernel's ephemeral range and not handed out before
    by this process.

    A server binds its ports only after tens of seconds of imports (minutes for a spare started idle).
    A port the kernel picked (``bind(0)``) could meanwhile be given to anyone binding port 0, vLLM's own
    ZMQ sockets included (``get_open_port``): seen in CI as ``Address already in use`` on the NIXL
    side channel, which stops stock vLLM's handshake listener so the engine never becomes ready. Ports
    below the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``) are never given out by the
    kernel, so a free one stays free until its server binds it.

    Raises:
        OSError: no free port found in 2000 random tries.
    """
    low, _ = _ephemeral_range()
    top, bottom = min(low, 65536) - 1, 10000 if low > 12000 else 1024
    rng = random.SystemRandom()
    for _ in range(2000):
        port = rng.randint(bottom, top)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise OSError(f"no free TCP port on {host} in [{bottom}, {top}] after 2000 tries")


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
