"""Faults applied on the host that holds their target, through :class:`leasekit.cluster.hosts.Host`
(over SSH for a server of the pair file on another machine): :func:`host_of` says which host that is
(None: this machine, where the local injectors run unchanged), :class:`HostSigstopStall` stops a
server's process group there, :class:`HostFreezerStall` freezes it with the cgroup freezer there
(:func:`leasekit.chaos.faults.kill.signal_engine_core` signals only its engine core there),
:class:`HostPartitionInjector` puts a partition's nftables rules into that host's own network stack
(``nft`` run on the host) with the SSH port kept out of them, and :func:`remote_site` gives a
partition its addresses and ports from the servers themselves; :class:`FaultFile` writes a
connector fault file where its server reads it.

The SSH port stays out of every partition: the controller's connection to a host carries the host
agent's heartbeat, and a host whose heartbeat is stale for ``stale_s`` seconds ends its servers
(:mod:`leasekit.cluster.hostagent`). So before a partition's rules, :class:`HostPartitionInjector`
inserts an ``accept`` for TCP to and from the host's SSH port at the head of each chain it uses.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

from leasekit.chaos.faults._common import FaultError, stamp
from leasekit.chaos.faults.partition import PartitionInjector, PartitionSite
from leasekit.cluster.hosttypes import HostError
from leasekit.vllm.faultpoints import read_state, state_path, write_control


def host_of(server):
    """The :class:`~leasekit.cluster.hosts.Host` a server runs on when it is another host's
    (a :class:`~leasekit.cluster.remote.RemoteVllmServer`), else None (this machine)."""
    return getattr(server, "host", None)


def _pgid(server) -> int:
    if server.proc is None:
        raise FaultError(f"server {server.spec.name} is not running")
    return int(server.proc.pid)


def monotonic_offset_on_host(host, pid: int) -> float | None:
    """The CLOCK_MONOTONIC offset (seconds) of ``pid``'s time namespace on ``host`` (its
    ``/proc/<pid>/timens_offsets``; 0.0 without time namespaces), or None when ``pid`` is gone there."""
    rc, out, _ = host.run(["sh", "-c", 'test -d /proc/$1 || exit 3; cat /proc/$1/timens_offsets 2>/dev/null; true', "sh",
                           str(int(pid))], timeout_s=30)
    if rc != 0:
        return None
    rows = [line.split() for line in out.splitlines()]
    return next((int(r[1]) + int(r[2]) / 1e9 for r in rows if len(r) == 3 and r[0] in ("monotonic", "1")), 0.0)


def thread_states(host, pids: list[int]) -> dict[int, list[str]]:
    """``{pid: [state letter of each thread]}`` read from ``/proc`` on ``host`` (gone pids left out)."""
    script = ('for p; do for s in /proc/$p/task/*/stat; do [ -r "$s" ] && echo "$p $(cut -d")" -f2 "$s" | '
              "cut -d' ' -f2)\"; done; done")
    rc, out, _ = host.run(["sh", "-c", script, "sh", *map(str, pids)], timeout_s=30)
    states: dict[int, list[str]] = {}
    for line in out.splitlines():
        pid, _, state = line.partition(" ")
        if pid.isdigit() and state:
            states.setdefault(int(pid), []).append(state.strip())
    return states


class HostSigstopStall:
    """SIGSTOP a remote server's whole process group on its host (SIGCONT on recovery), checking
    that every thread of every process shows ``T`` (stopped) there. ``record`` as
    :class:`leasekit.chaos.faults.stall.SigstopStall`'s: kind ``sigstop``, ``host``, ``pids``,
    ``all_threads_stopped``, ``injected_*``/``recovered_*`` stamps (``time.monotonic()``/``time.time()``
    of this process)."""

    def __init__(self, server, *, settle_timeout_s: float = 2.0):
        self.server, self.host, self.settle_timeout_s = server, host_of(server), settle_timeout_s
        self.record: dict = {}
        self._stopped = False

    def inject(self) -> None:
        """Stop the group now. Raises FaultError: the server is not running."""
        pgid = _pgid(self.server)
        pids = self.host.group_pids(pgid)
        self.record.update({"kind": "sigstop", "host": self.host.name, "pgid": pgid, "pids": pids})
        stamp(self.record, "injected")
        self._stopped = True
        self.host.signal_group(pgid, signal.SIGSTOP)
        deadline = time.monotonic() + self.settle_timeout_s
        while True:
            states = thread_states(self.host, pids)
            stopped = bool(states) and all(s in ("T", "t") for threads in states.values() for s in threads)
            if stopped or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        self.record["all_threads_stopped"] = stopped

    def recover(self) -> None:
        """SIGCONT the group; no-op if not stopped."""
        if not self._stopped:
            return
        self._stopped = False
        if self.server.proc is not None:
            self.host.signal_group(_pgid(self.server), signal.SIGCONT)
        stamp(self.record, "recovered")

    def cleanup(self) -> None:
        """Make sure the group runs again; idempotent."""
        self.recover()


FREEZER_DRIVER = """
import json, os, sys, time
from leasekit.chaos.faults.stall import FreezerStall
pids, limit, state, thaw = [int(p) for p in sys.argv[1].split(",")], float(sys.argv[2]), sys.argv[3], sys.argv[4]
def dump(record):
    with open(state + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(state + ".tmp", state)
stall = FreezerStall(pids)
try:
    stall.inject()
except Exception as exc:
    dump({"error": f"{type(exc).__name__}: {exc}"})
    raise SystemExit(1)
dump(stall.record)
end = time.monotonic() + limit
while time.monotonic() < end and not os.path.exists(thaw):
    time.sleep(0.02)
stall.recover()
stall.cleanup()
dump({**stall.record, "done": True})
"""
"""Runs on the host (its Python, with leasekit): freeze the pids there with
:class:`leasekit.chaos.faults.stall.FreezerStall`, hold until the thaw file appears (or ``limit`` s
pass, so a lost controller never leaves the server frozen), then thaw and clean up."""


class HostFreezerStall:
    """Freeze a remote server's processes with the cgroup freezer on its host: a driver process
    started there through the host agent (:data:`FREEZER_DRIVER`, a process group of the run, its
    cgroup on the run's manifest) holds the freeze until :meth:`recover`, at most ``max_s`` seconds.
    ``record``: kind ``freezer``, ``host``, ``frozen``, ``cgroup``, ``backend``, ``pids``, the host's
    own ``host_record``, and ``injected_*``/``recovered_*`` stamps on this process's clocks (the freeze
    instant read on the host's clock, converted with :meth:`Host.perf_counter`)."""

    def __init__(self, server, *, max_s: float = 600.0, timeout_s: float = 20.0):
        self.server, self.host, self.max_s, self.timeout_s = server, host_of(server), max_s, timeout_s
        self.record: dict = {}
        self._name: str | None = None

    def _state(self) -> dict:
        try:
            return json.loads(self.host.read_file(f"faults/{self._name}.json") or b"{}")
        except Exception:  # noqa: BLE001 - not written yet
            return {}

    def inject(self) -> None:
        """Freeze now. Raises FaultError: the freezer failed on the host (its reason), or no answer."""
        pids = self.host.group_pids(_pgid(self.server))
        self._name = f"freeze-{int(time.time() * 1000) % 10**9}"
        self.host.check(["mkdir", "-p", self.host.path("faults")])
        self.record.update({"kind": "freezer", "host": self.host.name, "pids": pids, "frozen": False})
        stamp(self.record, "injected")
        self.host.spawn([self.host.python, "-c", FREEZER_DRIVER, ",".join(map(str, pids)), f"{self.max_s:g}",
                         self.host.path(f"faults/{self._name}.json"), self.host.path(f"faults/{self._name}.thaw")],
                        name=self._name)
        deadline = time.monotonic() + self.timeout_s
        while not (state := self._state()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if "error" in state or not state.get("frozen"):
            self._name = None if "error" in state else self._name  # a driver that failed has nothing to thaw
            raise FaultError(f"freezer stall on host {self.host.name}: {state.get('error') or 'no answer from the driver'}")
        self.host.register("cgroup", state["cgroup"])
        offset = self.host.perf_counter().offset_s
        self.record.update({"frozen": True, "cgroup": state["cgroup"], "backend": state.get("backend"), "host_record": state,
                            "injected_monotonic_s": state["injected_monotonic_s"] - offset,
                            "injected_wall_s": state["injected_wall_s"]})

    def recover(self) -> None:
        """Thaw (the driver moves the processes back and removes the cgroup); no-op if not frozen.
        Raises FaultError: the driver did not report done within ``timeout_s``."""
        if self._name is None:
            return
        self.host.write_file(f"faults/{self._name}.thaw", "")
        deadline = time.monotonic() + self.timeout_s
        while not (state := self._state()).get("done") and time.monotonic() < deadline:
            time.sleep(0.05)
        self._name = None
        self.record["host_record"] = state
        stamp(self.record, "recovered")
        if not state.get("done"):
            raise FaultError(f"freezer stall on host {self.host.name}: no thaw reported within {self.timeout_s:g} s")

    def cleanup(self) -> None:
        """Make sure the processes are thawed; idempotent."""
        self.recover()


def remote_site(pair) -> PartitionSite | None:
    """The partition site of a pair whose two servers run on other hosts (addresses: the servers'
    ``url_host``; namespaces: the hosts' names, for messages only), or None when either runs here."""
    if host_of(pair.prefill) is None or host_of(pair.decode) is None:
        return None
    return PartitionSite(pair.prefill.spec.url_host, pair.decode.spec.url_host, f"host {pair.prefill.host.name}",
                         f"host {pair.decode.host.name}", pair.prefill.side_channel_port, pair.decode.side_channel_port,
                         pair.prefill.http_port, pair.decode.http_port)


class HostPartitionInjector(PartitionInjector):
    """:class:`PartitionInjector` whose ``nft`` runs on ``host`` (its own network stack), after an
    ``accept`` for the host's SSH port (``ssh_port``) at the head of each chain, removed with the rules."""

    def __init__(self, host, rules, *, ssh_port: int = 22, details: dict | None = None):
        super().__init__(f"host {host.name}", rules, details=details or {})
        self.host, self.ssh_port = host, int(ssh_port)
        self._guards: list[tuple[str, int]] = []

    def _nft(self, *args: str, stdin: str | None = None) -> str:
        rc, out, err = self.host.run(["nft", *args], timeout_s=30, input=stdin)
        if rc != 0:
            raise FaultError(f"nft {' '.join(args)} on host {self.host.name} exited {rc}: {err.strip()[-1000:]}")
        return out

    def inject(self) -> None:
        """Insert the SSH guards, then add the partition's rules (see :meth:`PartitionInjector.inject`)."""
        chains = sorted({r.chain for r in self.rules})
        setup = "add table inet leasekit\n" + "".join(
            f"add chain inet leasekit {c} {{ type filter hook {c} priority 0; policy accept; }}\n" for c in chains)
        self._nft("-f", "-", stdin=setup)
        for chain in chains:
            field = "dport" if chain == "input" else "sport"
            out = self._nft("--echo", "--handle", "insert", "rule", "inet", "leasekit", chain, "tcp", field,
                            str(self.ssh_port), "accept")
            match = re.search(r"# handle (\d+)", out)
            if match:
                self._guards.append((chain, int(match.group(1))))
        self.details["ssh_port_kept_out"] = self.ssh_port
        super().inject()

    def recover(self) -> None:
        """Delete the rules, then the SSH guards."""
        super().recover()
        guards, self._guards = self._guards, []
        if guards:
            self._nft("-f", "-", stdin="".join(f"delete rule inet leasekit {c} handle {h}\n" for c, h in guards))


class FaultFile:
    """The connector fault-control file of one role, where its server reads it: on this machine
    (:meth:`leasekit.cluster.pair.PDPair.fault_file`, :func:`leasekit.vllm.faultpoints.write_control`)
    or, for a server on another host, at the ``LEASEKIT_FAULT_FILE`` path it was given there (written
    through the host: a temporary file renamed over it, so the connector never reads half a file)."""

    def __init__(self, pair, role: str):
        server = getattr(pair, role)
        self.host = host_of(server)
        self.path = server.spec.extra_env.get("LEASEKIT_FAULT_FILE") if self.host else str(pair.fault_file(role))

    def write(self, control: dict) -> int:
        """Replace the control with ``control``; returns its ``seq``.

        Raises:
            FaultError: the server was started without a fault file."""
        if not self.path:
            raise FaultError("the server was started without a fault file (LEASEKIT_FAULT_FILE)")
        if self.host is None:
            return write_control(self.path, control)
        control = {**control, "seq": control.get("seq", time.monotonic_ns())}
        self.host.write_file(self.path + ".tmp", json.dumps(control))
        self.host.check(["mv", "-f", self.path + ".tmp", self.path])
        return control["seq"]

    def state(self) -> dict | None:
        """What the server's TP rank 0 worker last reported applying, or None."""
        if self.host is None:
            return read_state(self.path)
        try:
            return json.loads(self.host.read_file(state_path(self.path, 0)))
        except (HostError, ValueError):
            return None

    def clear(self) -> None:
        """Empty the control (no fault) if the file exists."""
        if not self.path:  # a server started without fault files
            return
        exists = os.path.exists(self.path) if self.host is None else self.host.run(["test", "-f", self.path])[0] == 0
        if exists:
            self.write({})
