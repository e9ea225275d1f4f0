"""vLLM servers on another machine: :class:`RemoteVllmServer` starts the very command line
:class:`~leasekit.cluster.server.VllmServer` builds, on a :class:`~leasekit.cluster.hosts.Host`
(usually an :class:`~leasekit.cluster.sshhost.SshHost`), as a detached process group there; the
controller reaches it over HTTP at ``spec.url_host``. Plus the pair-file glue the pair and the
preflight use: :func:`server_on_host`, :func:`runner_for`, :func:`host_for` and :func:`teardown_hosts`.

On the host, a server's run directory is ``<workdir>/<suite run>/pairs/<pair>`` (what ``--plan``
prints) and its log ``logs/<name>.log`` in the host's run directory; :meth:`RemoteVllmServer.stop`
copies the log back to ``log_path`` here and :meth:`RemoteVllmServer.collect` the files the connector
wrote. One :class:`SshHost` per pair-file host serves every server started there (restarts too);
:func:`teardown_hosts` (also at interpreter exit) fetches the logs and tears the hosts down.
"""

from __future__ import annotations

import atexit
import hashlib
import signal
import threading
import time
import weakref
from pathlib import Path, PurePosixPath

from leasekit.cluster.hosts import Host, HostError
from leasekit.cluster.procs import wait_until
from leasekit.cluster.server import ServerStartError, ServerStartTimeout, VllmServer
from leasekit.cluster.serverspec import ServerSpec
from leasekit.cluster.sleepfix import install_on_host, shim_name

SHIPPED_MODELS = "/tmp/leasekit-models"
"""Where a small model directory made on this machine is copied on a server's host, under a name
from its content: an absolute path that is the same on every host (vLLM hashes the model path into
NIXL's compatibility hash, so P and D must name one path), removed at teardown."""

FREE_PORT = """
import random, socket, sys
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(2000):
    port = random.randint(10000 if low > 12000 else 1024, low - 1)
    with socket.socket() as s:
        try:
            s.bind((sys.argv[1], port))
        except OSError:
            continue
    print(port)
    break
"""
"""Prints a free TCP port below the host's ephemeral range (as :func:`leasekit.cluster.procs.free_port`)."""


class RemoteProcess:
    """What ``VllmServer.proc`` offers, for a process group on a host: ``pid`` (= pgid), ``poll()``
    (None while the leader runs, then -1: its exit code is not known here) and ``wait(timeout)``."""

    def __init__(self, host: Host, pgid: int):
        self.host, self.pid, self.returncode = host, pgid, None

    def poll(self) -> int | None:
        if self.returncode is None and self.pid not in self.host.group_pids(self.pid):
            self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not wait_until(lambda: self.poll() is not None, 1e9 if timeout is None else timeout):
            raise TimeoutError(f"process {self.pid} on host {self.host.name} still running after {timeout} s")
        return self.returncode


class RemoteVllmServer(VllmServer):
    """A :class:`VllmServer` whose process group runs on ``host``; same spec, command line and
    environment (:meth:`launch_environment`, added to the host's own), same public methods.

    Args:
        spec: the server (``bind_host`` 0.0.0.0 and ``url_host`` the host's address to be reached).
        host: where it runs. local_run_dir: this machine's run directory (logs come back there).
        remote_run_dir: its run directory on the host (default ``pairs/<local_run_dir name>`` in the
            host's run directory). python: the host's interpreter with vLLM (default ``host.python``).

    Idle spares (``start(idle=True)``) are not supported on another host.
    """

    def __init__(self, spec: ServerSpec, host: Host, local_run_dir: str | Path, *,
                 remote_run_dir: str | None = None, python: str | None = None):
        local_run_dir = Path(local_run_dir)
        super().__init__(spec, Path(remote_run_dir or host.path(f"pairs/{local_run_dir.name}")), python=python or host.python)
        self.host, self.local_run_dir = host, local_run_dir
        self.log_path = local_run_dir / "logs" / f"{spec.name}.log"
        self.remote_log = host.path(f"logs/{local_run_dir.name}-{spec.name}.log")
        _SERVERS.add(self)

    def _free_port(self) -> int:
        return int(self.host.check([self.python, "-c", FREE_PORT, self.spec.bind_host]).split()[-1])

    def start(self, *, idle: bool = False) -> None:
        """Start the server on the host; returns at once (see :meth:`wait_healthy`).

        Raises:
            RuntimeError: already started. ValueError: ``idle`` (not supported remotely).
            HostError: the host refused (unreachable, no Python, ...).
        """
        if idle:
            raise ValueError(f"server {self.spec.name}: idle spares run on this machine only; fix: start it with idle=False")
        if self.proc is not None:
            raise RuntimeError(f"server {self.spec.name} already started")
        self.http_port = self.http_port or self._free_port()
        self.side_channel_port = self.side_channel_port or self._free_port()
        self.host.check(["mkdir", "-p", str(self.run_dir)])
        self._ship_launch_files()
        pgid = self.host.spawn(self.command(), env=self.launch_environment(), cwd=str(self.run_dir),
                               log_path=self.remote_log, name=f"{self.local_run_dir.name}-{self.spec.name}")
        self.proc, self.started_at, self.idle = RemoteProcess(self.host, pgid), time.monotonic(), False
        self.pin()

    def _ship_launch_files(self) -> None:
        """Put on the host what the launch names on this machine, and point the spec at it: a small
        model directory made here (the tiny model's ``config.json``; at most 1 MiB) is copied to
        ``SHIPPED_MODELS/<content hash>`` (the same path on P's and D's hosts), the logging config into
        the host's run directory; the connector fault file
        (``LEASEKIT_FAULT_FILE``) becomes a path there (the faults write it through the host); a
        libfaketime shim (``LD_PRELOAD``) must exist there. vLLM's IPC sockets go to a ``/tmp/lk-rpc-*``
        directory the host's teardown removes (unless the spec sets ``VLLM_RPC_BASE_PATH``).

        Raises:
            HostError: the shim is missing on the host (with the fix)."""
        import dataclasses

        here = f"{self.local_run_dir.name}-{self.spec.name}"
        model = Path(str(self.spec.model_dir))
        if model.is_dir() and (model / "config.json").is_file():
            files = sorted(f for f in model.rglob("*") if f.is_file())
            if sum(f.stat().st_size for f in files) <= 1 << 20:
                # P and D must give vLLM the same model path: it is part of NIXL's compatibility hash
                # (vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py), and a mismatch
                # fails every handshake. So the same absolute path on every host, named by content.
                digest = hashlib.sha256(b"".join(str(f.relative_to(model)).encode() + b"\0" + f.read_bytes() for f in files))
                pair_model = f"{SHIPPED_MODELS}/{digest.hexdigest()[:16]}"
                self.host.check(["mkdir", "-p", *sorted({f"{pair_model}/{f.relative_to(model).parent}" for f in files})])
                self.host.register("dir", pair_model)
                for f in files:
                    target, data = f"{pair_model}/{f.relative_to(model)}", f.read_bytes()
                    if self.host.run(["cmp", "-s", "-", target], input=data)[0] != 0:  # not there yet
                        self.host.write_file(target, data)
                self.spec = dataclasses.replace(self.spec, model_dir=Path(pair_model))
        env = dict(self.spec.extra_env)
        config = env.get("VLLM_LOGGING_CONFIG_PATH")
        if config and Path(config).is_file():
            self.host.check(["mkdir", "-p", self.host.path("config")])
            env["VLLM_LOGGING_CONFIG_PATH"] = self.host.write_file(f"config/{here}-logging.json", Path(config).read_bytes())
        if env.get("LEASEKIT_FAULT_FILE"):
            self.host.check(["mkdir", "-p", self.host.path("faults")])
            env["LEASEKIT_FAULT_FILE"] = self.host.path(f"faults/{here}.json")
        if env.get("LD_PRELOAD"):
            env["LD_PRELOAD"] = self._preload_on_host(env["LD_PRELOAD"])
        if "VLLM_RPC_BASE_PATH" not in env:  # vLLM's ZMQ IPC sockets: a directory the teardown removes, not /tmp
            env["VLLM_RPC_BASE_PATH"] = self.host.check(["mktemp", "-d", "/tmp/lk-rpc-XXXXXXXX"]).strip()
            self.host.register("dir", env["VLLM_RPC_BASE_PATH"])
        self.spec = dataclasses.replace(self.spec, extra_env=env)

    def _preload_on_host(self, preload: str) -> str:
        """``LD_PRELOAD`` as the host must see it: the libfaketime sleep shim built on the host
        (:func:`leasekit.cluster.sleepfix.install_on_host`), every other library checked there.

        Raises:
            HostError: a preloaded library is missing on the host (libfaketime: fix names the Debian
                package), or the shim cannot be built there."""
        paths = []
        for path in preload.split():
            if PurePosixPath(path).name == shim_name():
                paths.append(install_on_host(self.host))
            elif self.host.run(["test", "-f", path])[0] == 0:
                paths.append(path)
            else:
                raise HostError(f"host {self.host.name}: {path} (LD_PRELOAD of a skewed clock) is not there; fix: install it "
                                "on that host (libfaketime: apt-get install faketime)")
        return " ".join(paths)

    def promote(self) -> int:
        """Resume it if parked (nothing else to do: it never starts idle); returns 0."""
        self.unpark()
        return 0

    def park(self) -> bool:
        """Never parks (no idle spares on another host); returns False."""
        return False

    def unpark(self) -> None:
        """SIGCONT it if parked (no-op otherwise)."""
        if self.parked and self.proc is not None:
            self.host.signal_group(self.proc.pid, signal.SIGCONT)
        self.parked = False

    def alive(self) -> bool:
        """Whether the API server (the group leader) still runs on the host."""
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout_s: float = 300.0, *, from_now: bool = False) -> float:
        """Block until ``/health`` answers 200 (then pin); returns seconds since start.

        Raises:
            ServerStartError: it exited (log tail included). ServerStartTimeout: ``timeout_s`` passed.
        """
        if self.proc is None or self.started_at is None:
            raise RuntimeError(f"server {self.spec.name} not started")
        deadline = (time.monotonic() if from_now else self.started_at) + timeout_s
        while True:
            if not self.alive():
                raise ServerStartError(f"{self.spec.name} on host {self.host.name} exited while starting; "
                                       f"log {self.remote_log} there:\n{self.log_tail()}")
            if self.healthy():
                self.pin()
                return time.monotonic() - self.started_at
            if time.monotonic() >= deadline:
                raise ServerStartTimeout(f"{self.spec.name} on host {self.host.name} not healthy after {timeout_s:.0f} s; "
                                         f"log {self.remote_log} there:\n{self.log_tail()}")
            time.sleep(0.5)

    def pids(self) -> list[int]:
        """Pids of every live process of the server on the host."""
        return [] if self.proc is None else self.host.group_pids(self.proc.pid)

    def api_server_pid(self) -> int | None:
        """The API server's pid on the host (the group leader), or None once it is gone."""
        return self.proc.pid if self.alive() else None

    def pin(self) -> int:
        """Pin every thread of every process to the spec's cores; returns processes pinned (0: unpinned)."""
        if self.spec.cpu is None or self.proc is None:
            return 0
        return self.host.pin(self.proc.pid, [int(c) for c in self.spec.cpu_list().split(",")])

    def kill(self, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to the whole group on the host; returns the pids signalled (SIGKILL: waits
        until they are gone)."""
        if self.proc is None:
            return []
        pids = self.pids()
        self.host.signal_group(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            wait_until(lambda: not self.pids(), 10)
        return pids

    def begin_stop(self) -> None:
        """SIGTERM the whole group without waiting."""
        self.unpark()
        if self.proc is not None:
            self.host.signal_group(self.proc.pid, signal.SIGTERM)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the group, SIGKILL after ``grace_s`` s, then copy the log back to ``log_path``;
        idempotent; a no-op once the host was torn down (teardown ended the group)."""
        if self.host.closed:
            return
        self.unpark()
        if self.proc is not None and self.pids():
            self.host.signal_group(self.proc.pid, signal.SIGTERM)
            if not wait_until(lambda: not self.pids(), grace_s):
                self.kill(signal.SIGKILL)
        self.fetch_log()

    def fetch_log(self) -> Path | None:
        """Copy the host's log of this server to ``log_path``; None if there is none (yet)."""
        try:
            return self.host.fetch(self.remote_log, self.log_path)
        except HostError:
            return None

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log (read on the host; the local copy if unreachable)."""
        try:
            text = self.host.read_file(self.remote_log).decode(errors="replace")
        except HostError:
            text = self.log_path.read_text(errors="replace") if self.log_path.exists() else "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def collect(self, local_dir: str | Path | None = None) -> list[Path]:
        """Copy every file of the server's run directory on the host (spans, telemetry) under
        ``local_dir`` (default ``local_run_dir/hosts/<host>``), and the log; returns the local paths."""
        target = Path(local_dir) if local_dir is not None else self.local_run_dir / "hosts" / self.host.name
        rc, out, _ = self.host.run(["find", str(self.run_dir), "-type", "f"])
        copied = [self.host.fetch(path, target / Path(path).relative_to(self.run_dir)) for path in out.split() if rc == 0]
        log = self.fetch_log()
        return copied + ([log] if log else [])


_SERVERS: "weakref.WeakSet[RemoteVllmServer]" = weakref.WeakSet()
_HOSTS: dict[tuple, Host] = {}
_HOSTS_LOCK = threading.Lock()


def host_for(name: str, host_spec, *, run_name: str | None = None) -> Host:
    """The one :class:`~leasekit.cluster.sshhost.SshHost` of pair-file host ``name``
    (``[hosts.<name>]``: address, ssh_port, user, identity_file, known_hosts, python, workdir) in this process."""
    from leasekit.cluster.sshhost import SshHost

    key = (name, host_spec.address, host_spec.ssh_port, host_spec.user)
    with _HOSTS_LOCK:
        if key not in _HOSTS:
            _HOSTS[key] = SshHost(name, host_spec.address, port=host_spec.ssh_port, user=host_spec.user,
                                  identity_file=host_spec.identity_file,
                                  known_hosts=getattr(host_spec, "known_hosts", None), python=host_spec.python or "python3",
                                  workdir=host_spec.workdir or "/tmp/leasekit", run_name=run_name)
        elif run_name is not None:  # made earlier for host checks, which make nothing there: name it now
            _HOSTS[key].name_run(run_name)
        return _HOSTS[key]


def server_on_host(pair, role: str, spec: ServerSpec, run_dir: str | Path) -> RemoteVllmServer:
    """The server of ``role`` on the pair file's host of that role; ``run_dir`` is the pair's run
    directory here (``<suite run>/pairs/<pair>``: the host's run directory is named after the suite run)."""
    run_dir = Path(run_dir)
    name = pair.role(role).host
    suite = run_dir.parent.parent.name if run_dir.parent.name == "pairs" else None
    return RemoteVllmServer(spec, host_for(name, pair.host(name), run_name=suite), run_dir, python=pair.python(role))


def runner_for(name: str, host_spec):
    """``argv -> (exit code, stdout, stderr)`` on that host over SSH, 120 s per command; an
    unreachable host answers exit code 255 (as ``ssh`` does) with the reason and fix as stderr."""
    host = host_for(name, host_spec)

    def run(argv: list[str]) -> tuple[int, str, str]:
        try:
            return host.run(argv, timeout_s=120)
        except HostError as exc:
            return 255, "", str(exc)

    return run


def teardown_hosts() -> list[str]:
    """Stop every remote server (copying its log back), then tear down every host :func:`host_for`
    made (each once); returns the problems met (a host it could not reach is cleaned by its watchdog)."""
    problems = []
    for server in list(_SERVERS):
        try:
            server.stop(grace_s=3)
        except HostError as exc:
            problems.append(str(exc))
    with _HOSTS_LOCK:
        hosts = list(_HOSTS.values())
        _HOSTS.clear()
    for host in hosts:
        try:
            host.teardown()
        except HostError as exc:
            problems.append(str(exc))
    return problems


atexit.register(teardown_hosts)
