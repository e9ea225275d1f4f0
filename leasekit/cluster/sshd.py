"""An OpenSSH server (Debian ``openssh-server``) for one host of a test bed: run inside the host's
network namespace on its address, with keys made for the run, so that the controller reaches that
"host" over real SSH (:class:`~leasekit.cluster.sshhost.SshHost`) as it would a separate machine.

The server runs as ``ip netns exec NS /usr/sbin/sshd -D -e -f /dev/null -h HOSTKEY -o ...`` (no
system configuration read; ``ListenAddress``/``Port``/``AuthorizedKeysFile``/``PidFile`` set here,
``StrictModes no``, root login by key only, SFTP through ``internal-sftp``). Host and client keys are
Ed25519 keys made with ``ssh-keygen`` in a temporary state directory, which also holds
``known_hosts`` for the client. Needs root, ``ip`` and ``/usr/sbin/sshd``
(``apt-get install openssh-server``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = "/run/sshd"  # OpenSSH refuses to start without its privilege-separation directory


class SshServerError(RuntimeError):
    """sshd is missing, or did not start (the message has its log)."""


class SshServer:
    """One ``sshd`` listening on ``address:port`` inside network namespace ``namespace`` (None: this
    namespace). :meth:`start` and :meth:`stop` are idempotent; also a context manager.

    Attributes (after start): ``client_key`` (private key to log in as ``user``), ``known_hosts``
    (a known_hosts file naming this server's host key), ``pid``, ``log_path``.

    Args:
        address: address to listen on (must be configured in the namespace).
        namespace: ``ip netns`` name, or None.
        port: TCP port, 1..65535.
        user: the login user the client key is authorised for (the keys file is used for any user).
        state_dir: where keys, pid file and log go; default a new temporary directory (removed by stop).
        start_timeout_s: seconds to wait for the pid file (written once sshd listens).

    Raises:
        ValueError: bad port.
    """

    def __init__(self, address: str, *, namespace: str | None = None, port: int = 22, user: str = "root",
                 state_dir: str | Path | None = None, start_timeout_s: float = 10.0):
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"port must be an int in 1..65535, got {port!r}")
        self.address, self.namespace, self.port, self.user = address, namespace, port, user
        self._own_dir = state_dir is None
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.start_timeout_s = start_timeout_s
        self.pid: int | None = None
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "SshServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def client_key(self) -> Path:
        return self._dir / "client_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self._dir / "known_hosts"

    @property
    def log_path(self) -> Path:
        return self._dir / "sshd.log"

    @property
    def pid_file(self) -> Path:
        return self._dir / "sshd.pid"

    @property
    def _dir(self) -> Path:
        if self.state_dir is None:
            raise RuntimeError("SshServer not started: no state directory yet")
        return self.state_dir

    def command(self) -> list[str]:
        """The sshd command line (inside ``ip netns exec`` when a namespace is given)."""
        d = self._dir
        options = {
            "ListenAddress": self.address, "Port": str(self.port), "AuthorizedKeysFile": str(d / "authorized_keys"),
            "PidFile": str(self.pid_file), "StrictModes": "no", "PermitRootLogin": "prohibit-password",
            "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no", "UsePAM": "no",
            "Subsystem": "sftp internal-sftp", "UseDNS": "no", "PrintMotd": "no", "MaxStartups": "100",
            "MaxSessions": "100", "ClientAliveInterval": "5", "ClientAliveCountMax": "3",
        }
        prefix = ["ip", "netns", "exec", self.namespace] if self.namespace else []
        return [*prefix, SSHD, "-D", "-e", "-f", "/dev/null", "-h", str(d / "host_ed25519"),
                *(arg for key, value in options.items() for arg in ("-o", f"{key} {value}"))]

    def running(self) -> bool:
        """Whether the listening sshd of this server is alive."""
        return self.pid is not None and _is_sshd(self.pid)

    def start(self) -> "SshServer":
        """Make the keys (first start), start sshd and wait until it listens; no-op if running.

        Raises:
            SshServerError: ``/usr/sbin/sshd`` missing (fix: ``apt-get install openssh-server``), or
                sshd exited or wrote no pid file within ``start_timeout_s`` (its log included).
        """
        if self.running():
            return self
        if not os.access(SSHD, os.X_OK):
            raise SshServerError(f"{SSHD} not found; fix: apt-get install openssh-server")
        if self.state_dir is None:
            self.state_dir = Path(tempfile.mkdtemp(prefix="leasekit-sshd-"))
        self._dir.mkdir(parents=True, exist_ok=True)
        self._make_keys()
        os.makedirs(PRIVSEP_DIR, mode=0o755, exist_ok=True)
        self.pid_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while (pid := _read_pid(self.pid_file)) is None:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._kill()
                raise SshServerError(f"sshd on {self.address}:{self.port} (namespace {self.namespace}) did not start; "
                                     f"log {self.log_path}:\n{self.log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.02)
        self.pid = pid
        return self

    def _make_keys(self) -> None:
        d = self._dir
        for key in ("host_ed25519", "client_ed25519"):
            if not (d / key).exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"leasekit-{key}", "-f", str(d / key)],
                               check=True, capture_output=True)
        shutil.copyfile(d / "client_ed25519.pub", d / "authorized_keys")
        host = self.address if self.port == 22 else f"[{self.address}]:{self.port}"
        key_type, key_b64 = (d / "host_ed25519.pub").read_text().split()[:2]
        (d / "known_hosts").write_text(f"{host} {key_type} {key_b64}\n")

    def ssh_host(self, name: str, **kwargs):
        """An :class:`~leasekit.cluster.sshhost.SshHost` logging into this server with its keys."""
        from leasekit.cluster.sshhost import SshHost

        return SshHost(name, self.address, port=self.port, user=self.user, identity_file=self.client_key,
                       known_hosts=self.known_hosts, **kwargs)

    def stop(self, *, keep_state: bool = False) -> None:
        """SIGKILL sshd and the sshd process of every session it serves, as a crashed server or a
        lost network would end them (the sessions' commands see their input and output close; nothing
        else of theirs is killed); remove a temporary state dir unless ``keep_state``. Idempotent."""
        self._kill()
        if self._own_dir and not keep_state and self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self.state_dir = None

    def _kill(self) -> None:
        pids = [self.pid] if self.pid is not None else []
        if self.state_dir is not None and _read_pid(self.pid_file) is not None:
            pids.append(_read_pid(self.pid_file))
        pids = [pid for pid in pids if _is_sshd(pid)]  # a pid file can outlive its sshd: never kill a reused pid
        if self._proc is not None:
            pids.append(self._proc.pid)
        victims = {}
        for pid in set(pids):
            try:
                proc = psutil.Process(pid)
                victims[proc.pid] = proc
                victims.update((c.pid, c) for c in proc.children(recursive=True) if _is_sshd(c.pid))
            except psutil.Error:
                continue
        for proc in victims.values():
            try:
                proc.kill()
            except psutil.Error:
                pass
        deadline = time.monotonic() + 5  # a killed process counts as gone once it is a zombie
        while time.monotonic() < deadline and any(_is_sshd(pid) for pid in victims):
            time.sleep(0.02)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._proc, self.pid = None, None


def _read_pid(path: Path) -> int | None:
    """The pid in ``path``, or None while it is missing or not written yet."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _is_sshd(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and os.path.basename(proc.exe()) == "sshd"
    except (psutil.Error, OSError):
        return False


def listening(address: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connect to ``address:port`` from this namespace succeeds within ``timeout_s``."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False
