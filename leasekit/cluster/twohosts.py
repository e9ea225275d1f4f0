"""A two-host deployment on this machine, for ``leasekit chaos run --testbed two-hosts``: a
:class:`~leasekit.cluster.testbed.Testbed` with hosts ``prefill`` and ``decode`` (a network namespace
each, on one bridge), an ``sshd`` in each (:class:`~leasekit.cluster.sshd.SshServer`, host and client
keys made for the run, a ``known_hosts`` file naming each host key), and a normal pair file written
into the run directory whose ``[hosts.prefill]`` and ``[hosts.decode]`` are those two SSH hosts. A run
on that pair file starts P and D over SSH (paramiko), each on its own host; NIXL/UCX traffic between
them crosses the bridge (``UCX_TLS = "^sm"``: no shared-memory shortcut between the hosts).

:meth:`TwoHostDeployment.down` (also on exit of the context manager, so after Ctrl-C and SIGTERM too)
stops the servers and tears down every SSH host (:func:`leasekit.cluster.remote.teardown_hosts`),
stops both sshd and deletes the namespaces (which takes any partition rule with them).
"""

from __future__ import annotations

import sys
from pathlib import Path

from leasekit.cluster.pairfile import PairFile, load_pair_file

HOSTS = ("prefill", "decode")
MOUNT_CGROUPS = """
for rc in "$HOME/.bashrc" "$HOME/.profile"; do [ -f "$rc" ] && mount --bind /dev/null "$rc"; done
grep -q ' /sys/fs/cgroup ' /proc/self/mountinfo && exit 0
if [ "$(stat -fc %T /proc/1/root/sys/fs/cgroup)" = cgroup2fs ]; then
    exec mount -t cgroup2 cgroup2 /sys/fs/cgroup
fi
mount -t tmpfs cgroup_root /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/freezer && mount -t cgroup -o freezer freezer /sys/fs/cgroup/freezer
"""
"""Run in a host's first sshd session, in that sshd's mount namespace only (``ip netns exec`` made
it): the login user's shell start-up files are hidden (a fresh host: every SSH command then starts
in milliseconds, and none runs, or leaves a lock of, whatever this machine's ``.bashrc`` does), and
as ``ip netns exec`` gave the sshd a fresh ``/sys`` without cgroup mounts, the machine's cgroup v2
hierarchy, or the v1 freezer, is mounted there (the cgroup freezer stall needs it)."""
TESTBEDS = ("two-hosts",)
"""Values of ``leasekit chaos run --testbed``."""


def pair_file_text(hosts: dict[str, dict], *, python: str, workdir: str) -> str:
    """The pair file (TOML) of P on host ``prefill`` and D on host ``decode``.

    Args:
        hosts: per host name, ``address``, ``ssh_port``, ``identity_file``, ``known_hosts``.
        python: the interpreter with vLLM and leasekit on both hosts. workdir: run directories' root there.
    """
    lines = ["# Two SSH hosts of a testbed on this machine (written by `leasekit chaos run --testbed two-hosts`).",
             "# P runs on host prefill, D on host decode, each started over SSH; keys and known_hosts were made",
             "# for this run. The same file, with real addresses and keys, describes two real machines.", ""]
    for name in HOSTS:
        h = hosts[name]
        lines += [f"[hosts.{name}]", f'address = "{h["address"]}"', f"ssh_port = {int(h['ssh_port'])}", 'user = "root"',
                  f'identity_file = "{h["identity_file"]}"', f'known_hosts = "{h["known_hosts"]}"',
                  f'python = "{python}"', f'workdir = "{workdir}"', ""]
    for role in HOSTS:
        lines += [f"[{role}]", f'host = "{role}"', 'device = "cpu"',
                  "# hosts share no memory: KV blocks go over the network (UCX's TCP transport)",
                  'env = { UCX_TLS = "^sm" }', ""]
    return "\n".join(lines)


class TwoHostDeployment:
    """Build, describe and tear down the two-host testbed deployment (module doc).

    Args:
        run_dir: the run directory; the pair file is written there as ``two-hosts.toml``.
        python: the interpreter the hosts run (default this one: the hosts share this filesystem).
        workdir: run directories' root on the hosts.

    Attributes after :meth:`up`: ``pair_path``, ``pair`` (the parsed :class:`PairFile`), ``testbed``, ``sshd``.
    """

    def __init__(self, run_dir: str | Path, *, python: str = sys.executable, workdir: str = "/tmp/leasekit"):
        self.run_dir, self.python, self.workdir = Path(run_dir), python, workdir
        self.pair_path = self.run_dir / "two-hosts.toml"
        self.testbed = None
        self.sshd: dict = {}
        self.pair: PairFile | None = None

    def __enter__(self) -> "TwoHostDeployment":
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> PairFile:
        """Create the testbed, start an sshd on each host, write the pair file; returns it parsed.

        Raises:
            leasekit.cluster.iproute.TestbedError / leasekit.cluster.sshd.SshServerError: a step failed
                (everything made so far is undone first).
        """
        from leasekit.cluster.sshd import SshServer
        from leasekit.cluster.testbed import Testbed

        try:
            self.testbed = Testbed(list(HOSTS))
            hosts = {}
            for name in HOSTS:
                sshd = SshServer(self.testbed.address(name), namespace=self.testbed.namespace(name))
                self.sshd[name] = sshd.start()
                with sshd.ssh_host(name) as host:  # the host's own /sys/fs/cgroup, as a real host has
                    host.check(["sh", "-c", MOUNT_CGROUPS])
                hosts[name] = {"address": sshd.address, "ssh_port": sshd.port, "identity_file": str(sshd.client_key),
                               "known_hosts": str(sshd.known_hosts)}
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.pair_path.write_text(pair_file_text(hosts, python=self.python, workdir=self.workdir))
            self.pair = load_pair_file(self.pair_path)
        except BaseException:
            self.down()
            raise
        return self.pair

    def down(self) -> list[str]:
        """Stop every server on the hosts and tear the hosts down, stop both sshd, delete the
        namespaces and the bridge; idempotent. Returns the problems met (each also tried further)."""
        from leasekit.cluster.remote import teardown_hosts

        problems = list(teardown_hosts())
        for sshd in self.sshd.values():
            try:
                sshd.stop()
            except Exception as exc:  # noqa: BLE001 - the namespaces must go anyway
                problems.append(f"sshd {sshd.address}: {exc}")
        self.sshd = {}
        if self.testbed is not None:
            try:
                self.testbed.destroy()
            except Exception as exc:  # noqa: BLE001
                problems.append(f"testbed {self.testbed.id}: {exc}")
            self.testbed = None
        return problems
