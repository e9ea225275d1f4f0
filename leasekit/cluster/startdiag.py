"""Why a server has not become healthy: the evidence written when a start times out.

A vLLM server on this class of machine is healthy in 10-60 s; one that is still starting after the
start timeout is either starved of CPU (something else spins on its core) or stuck (a lock, a
socket, a busy-wait). :func:`diagnose_start` gathers what tells the two apart, so that a CI failure
can be explained from its output alone: the host's load, the processes using the most CPU and the
cores they may run on, the server's own processes and their states, the log's last timestamped
line, and (when ``py-spy`` is installed, as with ``leasekit[dev]``) every Python stack of every
server process, written next to the server log.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

_STAMP = re.compile(r"\b(\d\d-\d\d \d\d:\d\d:\d\d)\b")
"""vLLM's log time stamp (``MM-DD HH:MM:SS``)."""


def _py_spy() -> str | None:
    """The ``py-spy`` executable next to this interpreter, else on ``PATH``, else None."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def last_log_stamp(log_text: str) -> str | None:
    """The last ``MM-DD HH:MM:SS`` time stamp in a vLLM log, or None (pure)."""
    stamps = _STAMP.findall(log_text)
    return stamps[-1] if stamps else None


def top_cpu_processes(sample_s: float = 0.5, limit: int = 8) -> list[str]:
    """The ``limit`` processes using the most CPU over ``sample_s`` seconds, one line each:
    pid, CPU percent (100 = one core), allowed cores, state and command line (cut to 120 chars)."""
    procs = list(psutil.process_iter(["pid"]))
    for proc in procs:
        try:
            proc.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(sample_s)
    rows = []
    for proc in procs:
        try:
            percent = proc.cpu_percent(None)  # once: oneshot() would cache the CPU times a second call reads
            with proc.oneshot():
                rows.append(
                    (
                        percent,
                        f"pid {proc.pid} cpu {percent:5.1f}% cores {sorted(proc.cpu_affinity())} "
                        f"{proc.status()} {' '.join(proc.cmdline())[:120] or proc.name()}",
                    )
                )
        except psutil.Error:
            continue
    rows.sort(key=lambda row: row[0], reverse=True)
    return [line for _, line in rows[:limit]]


def dump_stacks(pids: list[int], out_path: Path, timeout_s: float = 20.0) -> str:
    """Write ``py-spy dump`` of each pid (native frames off) to ``out_path``; returns a one-line
    account (where it went, or why there is none). Never raises."""
    spy = _py_spy()
    if spy is None:
        return "no py-spy here (pip install py-spy, or leasekit[dev]) for the server's Python stacks"
    try:
        with open(out_path, "w") as out:
            for pid in pids:
                out.write(f"===== pid {pid} =====\n")
                out.flush()
                subprocess.run([spy, "dump", "--pid", str(pid)], stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"py-spy failed: {exc}"
    return f"Python stacks of pids {pids}: {out_path}"


def diagnose_start(name: str, pids: list[int], log_path: Path) -> str:
    """The evidence for a server ``name`` (its live ``pids``, its ``log_path``) that did not become
    healthy: a multi-line text for the error message. Never raises."""
    lines = [f"--- why {name} is not healthy (leasekit start diagnosis) ---"]
    try:
        load = os.getloadavg()
        lines.append(f"host: {os.cpu_count()} cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, now {time.strftime('%m-%d %H:%M:%S')}")
        try:
            stamp = last_log_stamp(log_path.read_text(errors="replace"))
        except OSError:
            stamp = None
        lines.append(f"last time stamp in {log_path.name}: {stamp or 'none'}")
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                lines.append(f"{name} pid {pid}: {proc.status()}, cores {sorted(proc.cpu_affinity())}, nice {proc.nice()}, "
                             f"cpu user {proc.cpu_times().user:.1f} s, {proc.num_threads()} threads: {' '.join(proc.cmdline())[:100]}")
            except psutil.Error as exc:
                lines.append(f"{name} pid {pid}: {exc}")
        lines.append("busiest processes on the host:")
        lines.extend(f"  {row}" for row in top_cpu_processes())
        lines.append(dump_stacks(pids, log_path.with_name(f"{log_path.stem}.stacks.txt")))
    except Exception as exc:  # diagnosis must never hide the original error
        lines.append(f"(diagnosis failed: {exc!r})")
    return "\n".join(lines)
