"""A host that is not this one, controlled over SSH (see :mod:`leasekit.cluster.hosts` for the
operations, the run directory and the watchdog).

The SSH library is paramiko: its API is synchronous, which fits the harness (plain threads, no event
loop to host, as asyncssh would need), it has SFTP built in (logs and span files come back with
:meth:`SshHost.fetch`), and it is widely used and maintained. fabric is a layer over paramiko whose
additions (task runner, connection config files, ``sudo`` helpers) this module does not use.

Commands run as ``timeout -k 2 T <argv quoted with shlex>`` so a command past its timeout also ends
on the host, not only here. Host keys are checked: against ``known_hosts`` (a file; default the
user's ``~/.ssh/known_hosts``), unknown keys refused unless ``accept_unknown_host_key``.
"""

from __future__ import annotations

import select
import shlex
import socket
import threading
import time
from pathlib import Path
from typing import Sequence

import paramiko

from leasekit.cluster.hosts import AgentSession, ClockReading, Host, HostError, HostTimeout, HostUnreachable, check_argv

CLOCK_SCRIPT = ("import sys, time\nprint('ready', flush=True)\n"
                "while sys.stdin.readline():\n    print(repr(time.perf_counter()), flush=True)\n")
CLOCK_SAMPLES = 7
AGENT_TIMEOUT_S = SFTP_TIMEOUT_S = 30.0
"""Seconds one agent or SFTP request may take before the connection counts as lost."""


class SshHost(Host):
    """A host reached over SSH at ``user@address:port`` with the private key ``identity_file``.

    Args:
        name: the host's name (pair file ``[hosts.<name>]``), used in every message.
        address: IP address or DNS name. port: SSH port (1..65535). user: login user (root for faults).
        identity_file: private key (OpenSSH or PEM format); None tries ``~/.ssh`` keys.
        known_hosts: a known_hosts file to check the host key against (None: ``~/.ssh/known_hosts``).
        accept_unknown_host_key: trust a host key that ``known_hosts`` does not list (test beds).
        connect_timeout_s: TCP connect, banner and authentication timeout, seconds.
        python / workdir / heartbeat_s / stale_s: see :class:`~leasekit.cluster.hosts.Host`.

    The connection opens on first use and reopens when lost. Raises ValueError: bad port.
    """

    def __init__(self, name: str, address: str, *, port: int = 22, user: str = "root",
                 identity_file: str | Path | None = None, known_hosts: str | Path | None = None,
                 accept_unknown_host_key: bool = False, connect_timeout_s: float = 10.0, **kwargs):
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"port of host {name!r} must be an int in 1..65535, got {port!r}")
        super().__init__(name, **kwargs)
        self.address, self.port, self.user = address, port, user
        self.identity_file = None if identity_file is None else str(identity_file)
        self.known_hosts = None if known_hosts is None else str(known_hosts)
        self.accept_unknown_host_key = accept_unknown_host_key
        self.connect_timeout_s = connect_timeout_s
        self._client: paramiko.SSHClient | None = None
        self._sftp_client: paramiko.SFTPClient | None = None
        self._conn_lock = threading.RLock()

    @property
    def where(self) -> str:
        return f"{self.user}@{self.address}:{self.port}"

    # -- connection ---------------------------------------------------------------------------
    def connect(self) -> paramiko.Transport:
        """The live SSH transport, (re)connecting if there is none.

        Raises:
            HostUnreachable: connection refused or timed out, host key unknown or changed, or login
                refused; the message names the host, its address and the fix.
        """
        with self._conn_lock:
            transport = self._client.get_transport() if self._client is not None else None
            if transport is not None and transport.is_active():
                return transport
            self._drop_client()
            client = paramiko.SSHClient()
            if self.known_hosts:
                client.load_host_keys(self.known_hosts)
            else:
                client.load_system_host_keys()
            client.set_missing_host_key_policy(
                paramiko.AutoAddPolicy() if self.accept_unknown_host_key else paramiko.RejectPolicy())
            here = f"host {self.name} ({self.where})"
            try:
                client.connect(self.address, port=self.port, username=self.user, key_filename=self.identity_file,
                               timeout=self.connect_timeout_s, banner_timeout=self.connect_timeout_s,
                               auth_timeout=self.connect_timeout_s, allow_agent=False,
                               look_for_keys=self.identity_file is None)
            except paramiko.BadHostKeyException as exc:
                raise HostUnreachable(f"{here}: host key changed ({exc}); fix: check the host, then update "
                                      f"{self.known_hosts or '~/.ssh/known_hosts'}") from exc
            except paramiko.AuthenticationException as exc:
                raise HostUnreachable(f"{here}: login refused ({exc}); fix: add the public key of "
                                      f"{self.identity_file or '~/.ssh/id_*'} to {self.user}'s authorized_keys on {self.name}") from exc
            except paramiko.SSHException as exc:
                fix = (f"add its key to {self.known_hosts or '~/.ssh/known_hosts'} (ssh-keyscan -p {self.port} {self.address}, "
                       "after checking the fingerprint)" if "known_hosts" in str(exc)
                       else f"check that sshd answers on {self.address}:{self.port}")
                raise HostUnreachable(f"{here}: SSH failed ({exc}); fix: {fix}") from exc
            except (OSError, socket.timeout) as exc:
                raise HostUnreachable(f"{here} unreachable ({exc}); fix: check that sshd listens on "
                                      f"{self.address}:{self.port} (pair file hosts.{self.name}.address / ssh_port) "
                                      "and that the network path is up") from exc
            self._client = client
            transport = client.get_transport()
            transport.set_keepalive(max(1, int(self.heartbeat_s)))
            return transport

    def drop_connection(self) -> None:
        """Close the TCP connection abruptly, with no SSH goodbye (simulates a lost connection)."""
        with self._conn_lock:
            transport = self._client.get_transport() if self._client is not None else None
            if transport is not None and transport.sock is not None:
                try:
                    transport.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _channel(self, command: str) -> paramiko.Channel:
        """A new session channel running ``command``; reconnects once if the connection turns out dead.

        Raises:
            HostUnreachable: no session could be opened (the message names the host and address).
        """
        for attempt in (1, 2):
            transport = self.connect()
            try:
                channel = transport.open_session(timeout=self.connect_timeout_s)
                channel.exec_command(command)
                return channel
            except (paramiko.SSHException, EOFError, OSError) as exc:
                self._drop_client()  # the transport looked alive but was not (a dropped connection)
                if attempt == 2:
                    raise HostUnreachable(f"host {self.name} ({self.where}): no SSH session ({exc!r}); "
                                          f"fix: check that sshd answers on {self.address}:{self.port}") from exc
        raise AssertionError("unreachable")

    def _open_agent(self) -> AgentSession:
        channel = self._channel(shlex.join(self.agent_command()))
        channel.settimeout(AGENT_TIMEOUT_S)
        lines = channel.makefile("rb")
        try:
            return AgentSession(self, channel.sendall, lines.readline, channel.close,
                                lambda: channel.makefile_stderr("rb").read().decode(errors="replace"))
        except socket.timeout as exc:
            channel.close()
            raise HostTimeout(f"host {self.name} ({self.where}): the host agent did not answer in {AGENT_TIMEOUT_S:g} s") from exc

    def _close(self) -> None:
        super()._close()
        self._drop_client()

    def _drop_client(self) -> None:
        # Lock order: Host._lock before _conn_lock, never the reverse (the heartbeat thread holds
        # _conn_lock for SFTP while the caller may hold Host._lock for an agent request).
        with self._conn_lock:
            for thing in (self._sftp_client, self._client):
                if thing is not None:
                    try:
                        thing.close()
                    except Exception:  # noqa: BLE001 - closing a dead connection
                        pass
            self._sftp_client = self._client = None

    def _sftp(self) -> paramiko.SFTPClient:
        transport = self.connect()
        if self._sftp_client is None or self._sftp_client.get_channel().get_transport() is not transport:
            self._sftp_client = paramiko.SFTPClient.from_transport(transport)
            self._sftp_client.get_channel().settimeout(SFTP_TIMEOUT_S)
        return self._sftp_client

    def _with_sftp(self, action):
        with self._conn_lock:  # one SFTP request at a time (heartbeat thread and caller share it)
            try:
                return action(self._sftp())
            except (EOFError, OSError, paramiko.SSHException):
                transport = self._client.get_transport() if self._client is not None else None
                if transport is not None and transport.is_active():
                    raise  # the host answered: a real error (no such file...)
                self._drop_client()  # a dead connection: retry once on a new one
            try:
                return action(self._sftp())
            except (EOFError, paramiko.SSHException) as exc:
                raise HostUnreachable(f"host {self.name} ({self.where}): SFTP failed twice ({exc!r})") from exc

    # -- primitives ---------------------------------------------------------------------------
    def run(self, argv: Sequence[str], timeout_s: float = 30.0, input: str | bytes | None = None) -> tuple[int, str, str]:
        argv = check_argv(argv)
        command = shlex.join(["timeout", "-k", "2", f"{timeout_s:g}", *argv])
        channel = self._channel(command)
        try:
            if input is not None:
                channel.sendall(input.encode() if isinstance(input, str) else input)
            channel.shutdown_write()
            out, err = bytearray(), bytearray()
            deadline = time.monotonic() + timeout_s + 5
            while True:
                if channel.recv_ready():
                    out += channel.recv(65536)
                elif channel.recv_stderr_ready():
                    err += channel.recv_stderr(65536)
                elif channel.exit_status_ready() and (channel.eof_received or channel.closed):
                    break
                elif channel.closed or not channel.get_transport().is_active():
                    raise HostUnreachable(f"host {self.name} ({self.where}): connection lost while running {shlex.join(argv)}")
                elif time.monotonic() > deadline:
                    raise HostTimeout(f"host {self.name} ({self.where}): {shlex.join(argv)} ran past {timeout_s:g} s")
                else:
                    select.select([channel], [], [], 0.05)
            return channel.recv_exit_status(), out.decode(errors="replace"), err.decode(errors="replace")
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise HostUnreachable(f"host {self.name} ({self.where}): connection lost while running "
                                  f"{shlex.join(argv)} ({exc!r})") from exc
        finally:
            channel.close()

    def _put(self, path: str, data: bytes) -> None:
        def put(sftp: paramiko.SFTPClient) -> None:
            with sftp.open(path, "wb") as handle:
                handle.write(data)
        self._with_sftp(put)

    def _get(self, path: str) -> bytes:
        def get(sftp: paramiko.SFTPClient) -> bytes:
            with sftp.open(path, "rb") as handle:
                return handle.read()
        return self._with_sftp(get)

    def fetch(self, remote: str, local: str | Path) -> Path:
        """Copy ``remote`` (relative: in the run dir) to ``local`` over SFTP; returns ``local``.

        Raises:
            HostError: the file cannot be read on the host.
        """
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        source = self.path(remote)
        try:
            self._with_sftp(lambda sftp: sftp.get(source, str(local)))
        except OSError as exc:
            raise HostError(f"host {self.name} ({self.where}): cannot fetch {source}: {exc}") from exc
        return local

    def perf_counter(self, timeout_s: float = 10.0) -> ClockReading:
        """The host's ``time.perf_counter()``, read by its Python in a session kept open for
        ``CLOCK_SAMPLES`` reads: the read with the shortest round trip counts, placed at its midpoint
        (so ``± rtt / 2``) and carried to the moment it returned.

        Raises:
            HostError: the host's Python did not answer within ``timeout_s`` seconds.
        """
        channel = self._channel(shlex.join([self.python, "-u", "-c", CLOCK_SCRIPT]))
        channel.settimeout(timeout_s)
        try:
            lines = channel.makefile("rb")
            if lines.readline().strip() != b"ready":
                raise HostTimeout(f"host {self.name} ({self.where}): {self.python} did not start the clock reader: "
                                  f"{channel.makefile_stderr('rb').read().decode(errors='replace')[-500:]}")
            best = None
            for _ in range(CLOCK_SAMPLES):
                sent = time.perf_counter()
                channel.sendall(b"\n")
                value = float(lines.readline())
                back = time.perf_counter()
                if best is None or back - sent < best[1] - best[0]:
                    best = (sent, back, value)
            sent, back, value = best
            half = (back - sent) / 2
            return ClockReading(value + half, half, back)
        except (socket.timeout, ValueError) as exc:
            raise HostTimeout(f"host {self.name} ({self.where}): clock read failed ({exc!r})") from exc
        finally:
            channel.close()
