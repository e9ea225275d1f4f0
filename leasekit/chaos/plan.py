"""``leasekit chaos run --plan``: every command a run would execute, grouped per host, executing
nothing (no server, namespace, cgroup or file).

Server lines come from the very :class:`leasekit.cluster.server.VllmServer` objects a run builds
(:meth:`leasekit.cluster.pair.PDPair.planned`: same ``command()`` and ``launch_environment()``), so the
plan cannot drift from the run; fault lines come from each injector's ``plan_commands`` next to it.
What only the run can know (pids, free ports, a namespace's /30, random ids) is a ``<placeholder>``.
The pair sharing mirrors :class:`leasekit.chaos.pool.PairPool`: a pair is reused while the launch
conditions match, it was started warm and P is alive; a D a scenario killed is restarted.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from leasekit.chaos.faults import kill, stall
from leasekit.chaos.faults._cgroup import hierarchy_roots
from leasekit.chaos.pool import pair_spec
from leasekit.chaos.scenario import Scenario
from leasekit.chaos.schema import CONNECTOR_STALLS, HeartbeatFault, KillFault, NoFault, PartitionFault, StallFault
from leasekit.cluster import clockshift
from leasekit.cluster.pair import PDPair
from leasekit.cluster.pairfile import LOCAL, PairFile
from leasekit.cluster.preflight import role_commands
from leasekit.cluster.testbed import PlannedTestbed

ROLES = ("prefill", "decode")
SEQ = "<time.monotonic_ns()>"


@dataclass
class Step:
    """One thing a run does on ``host``: a command (``argv``, with ``env``: only the variables
    leasekit sets, ``cwd``, ``pin``: cores as ``taskset --cpu-list`` writes them, ``stdin``), a file write
    (``write``, ``content``), or, with neither, an action of this machine (HTTP, waiting)."""

    host: str
    phase: str
    what: str
    argv: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    pin: str | None = None
    write: str | None = None
    content: str | None = None
    stdin: str | None = None

    def to_json(self) -> dict:
        """The step as JSON (empty fields left out)."""
        return {key: value for key, value in asdict(self).items() if value not in (None, {}, [])}

    def text(self) -> list[str]:
        """Shell-like lines: ``# what``, then the command or the write."""
        lines = [f"# {self.what}"]
        if self.argv is not None:
            env = " ".join(f"{key}={shlex.quote(value)}" for key, value in self.env.items())
            pin = f"taskset --cpu-list {self.pin} " if self.pin else ""
            cd = f"cd {shlex.quote(self.cwd)} && " if self.cwd else ""
            heredoc = f" <<'EOF'\n{self.stdin.rstrip()}\nEOF" if self.stdin else ""
            lines.append(f"{cd}{'env ' + env + ' ' if env else ''}{pin}{shlex.join(self.argv)}{heredoc}")
        elif self.write is not None:
            lines.append(f"printf %s {shlex.quote(self.content or '')} > {shlex.quote(self.write)}")
        return lines


@dataclass
class Plan:
    """The whole plan: ``hosts`` (name -> address, this machine or SSH), ``steps`` in run order."""

    run_dir: str
    hosts: dict[str, dict]
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def by_host(self) -> dict[str, list[Step]]:
        """``{host: [steps in run order]}``, this machine first."""
        grouped: dict[str, list[Step]] = {name: [] for name in self.hosts}
        for step in self.steps:
            grouped.setdefault(step.host, []).append(step)
        return grouped

    def to_json(self) -> dict:
        """JSON for ``-o json``: ``run_dir``, ``notes``, ``hosts`` (each with its ``steps``)."""
        return {"run_dir": self.run_dir, "notes": self.notes, "executed": False,
                "hosts": {name: {**self.hosts.get(name, {}), "steps": [s.to_json() for s in steps]}
                          for name, steps in self.by_host().items()}}

    def text(self) -> str:
        """The plan for a terminal: per host, per phase, shell-like lines."""
        out = [f"# plan of a run in {self.run_dir}: nothing below was executed", *(f"# note: {n}" for n in self.notes)]
        for name, steps in self.by_host().items():
            host = self.hosts.get(name, {})
            out += ["", f"==== host {name}: {host.get('where', '')} ===="]
            phase = None
            for step in steps:
                if step.phase != phase:
                    phase = step.phase
                    out += ["", f"---- {phase} ----"]
                out += step.text()
        return "\n".join(out) + "\n"


def tools_needed(runs: list[tuple[Scenario, str]]) -> dict[str, list[str]]:
    """Programs the runs need on each role's host (``role -> [tool]``): ``unshare`` for a clock offset
    there, ``ip`` and ``nft`` for a network namespace."""
    needed: dict[str, set[str]] = {role: set() for role in ROLES}
    for scenario, _ in runs:
        launch = scenario.launch
        for role in ROLES:
            if getattr(launch, f"{role}_monotonic_offset_s"):
                needed[role].add("unshare")
            if launch.network_namespace:
                needed[role] |= {"ip", "nft"}
    return {role: sorted(tools) for role, tools in needed.items()}


class _Planner:
    def __init__(self, deployment: PairFile | None, run_dir: Path):
        self.given = deployment  # what the run's PairSpec carries (None: the CPU default, no file)
        self.dep, self.run_dir, self.steps, self.count = deployment or PairFile(), run_dir, [], 0
        self.current: dict | None = None  # {"key", "servers", "pairs", "reusable", "testbed", ...}

    # -- helpers -----------------------------------------------------------------------------
    def host(self, role: str) -> str:
        return self.dep.role(role).host

    def add(self, host: str, phase: str, what: str, **kw) -> None:
        self.steps.append(Step(host, phase, what, **kw))

    def add_all(self, host: str, phase: str, steps: list[dict], when: str = "") -> None:
        """Add ``steps`` (``{"what", "argv"|"write"...}``); ``when`` prefixes the first one."""
        for i, step in enumerate(steps):
            step = dict(step)
            self.add(host, phase, f"{when if i == 0 else ''}{step.pop('what')}", **step)

    def role_run_dir(self, role: str, name: str) -> Path:
        host = self.dep.host(self.host(role))
        if self.dep.is_local(self.host(role)):
            return self.run_dir / "pairs" / name
        return Path(host.workdir or "/tmp/leasekit") / self.run_dir.name / "pairs" / name

    # -- pairs -------------------------------------------------------------------------------
    def start_pair(self, spec, target: str) -> None:
        self.count += 1
        name, phase = f"{self.count:02d}-{spec.prefill_connector}", f"pair {self.count} ({target}, L={spec.lease_duration_s:g} s): start"
        testbed = PlannedTestbed(ROLES) if spec.network_namespace else None  # P and D each on its own host
        pairs = {role: PDPair.planned(spec, self.role_run_dir(role, name), testbed=testbed) for role in ROLES}
        if pairs["prefill"].testbed is None:  # P and D already on two other hosts: no namespaces made
            testbed = None
        servers = {role: getattr(pairs[role], role) for role in ROLES}
        for pair in pairs.values():  # ports picked at start: placeholders
            for role in ROLES:
                for port in ("http_port", "side_channel_port"):
                    if not getattr(getattr(pair, role), port):
                        setattr(getattr(pair, role), port, f"<free {role} {port.replace('_', ' ')}>")
        if testbed is not None:
            self.add_all(LOCAL, phase, [{"argv": argv, "what": what} for argv, what in testbed.create_steps()])
        for role in ROLES:
            self.add_all(self.host(role), phase, clockshift.plan_commands(getattr(spec, f"{role}_wall_offset_s"), getattr(spec, f"{role}_wall_rate")))
        for role in ROLES:
            self.start_server(servers[role], role, phase)
        for role in ROLES:
            self.ready(servers[role], role, phase)
        if spec.warm_up:
            self.add(LOCAL, phase, f"warm up: one request routed P -> D (POST {servers['prefill'].url}/v1/completions, then "
                                   f"{servers['decode'].url}/v1/completions with P's kv_transfer_params), then re-pin both")
        self.current = {"key": spec.launch_key(), "servers": servers, "pairs": pairs, "reusable": spec.warm_up,
                        "testbed": testbed, "decode_dead": False, "number": self.count}

    def start_server(self, server, role: str, phase: str, what: str = "start") -> None:
        cores = server.spec.cpu_list()
        self.add(self.host(role), phase, f"{what} {role} ({server.spec.connector} connector, {server.spec.device}) in its own "
                 f"session{f', pinned to core(s) {cores}' if cores else ''}; log {server.log_path}",
                 argv=server.command(), env=server.launch_environment(), cwd=str(server.run_dir), pin=cores)

    def ready(self, server, role: str, phase: str) -> None:
        self.add(LOCAL, phase, f"wait until GET {server.url}/health answers 200")
        cores = server.spec.cpu_list()
        if cores:
            self.add(self.host(role), phase, f"pin every thread of {role} (after /health and after warm-up)",
                     argv=["taskset", "--all-tasks", "--cpu-list", "--pid", cores, f"<each pid in the {role} process group>"])

    def stop_pair(self, phase: str) -> None:
        if self.current is None:
            return
        for role in ("decode", "prefill"):
            self.add(self.host(role), phase, f"stop {role}: SIGTERM to its process group",
                     argv=["kill", "-TERM", "--", f"-<pgid of {role}>"])
        for role in ("decode", "prefill"):
            self.add(self.host(role), phase, f"after up to 5 s, SIGKILL what is left of {role}",
                     argv=["kill", "-KILL", "--", f"-<pgid of {role}>"])
        if self.current["testbed"] is not None:
            self.add_all(LOCAL, phase, [{"argv": argv, "what": what} for argv, what in self.current["testbed"].destroy_steps()])
        self.current = None

    # -- scenarios ---------------------------------------------------------------------------
    def scenario(self, scenario: Scenario, target: str, needs_pair: bool) -> None:
        phase = f"{scenario.name} [{target}]"
        if not needs_pair:
            self.add(LOCAL, phase, "no pair: this target cannot take the fault, the verdict is UNKNOWN")
            return
        spec = pair_spec(scenario, target, self.given)
        cur = self.current
        if cur is None or cur["key"] != spec.launch_key() or not cur["reusable"]:
            self.stop_pair(f"pair {cur['number']}: stop" if cur else "stop")
            self.start_pair(spec, target)
        elif cur["decode_dead"]:
            self.start_server(cur["servers"]["decode"], "decode", phase, "restart (a scenario killed it)")
            self.ready(cur["servers"]["decode"], "decode", phase)
            cur["decode_dead"] = False
        cur = self.current
        w = scenario.workload
        if scenario.steady_state.enabled:
            self.add(LOCAL, phase, f"steady state: {w.requests} {w.kind} request(s) of {w.prompt_tokens} tokens routed P -> D (HTTP)")
        self.add(LOCAL, phase, "fault run: the workload with the faults below ('queued': every request waits in D's queue)")
        for fault in sorted(scenario.faults, key=scenario.fault_after_s):
            self.fault(fault, scenario, target, phase)
        if spec.fault_files:
            for role in ROLES:
                self.add(self.host(role), phase, f"clear {role}'s connector fault file (if it was written)",
                         write=str(cur["pairs"][role].fault_file(role)), content=json.dumps({"seq": SEQ}))
        if scenario.launch.warm_up is False:
            cur["reusable"] = False
        if any(isinstance(f, KillFault) and f.target == "prefill" for f in scenario.faults):
            cur["reusable"] = False

    def fault(self, fault, scenario: Scenario, target: str, phase: str) -> None:
        if isinstance(fault, NoFault):
            self.add(LOCAL, phase, "no fault (the launch conditions or the load are the test)")
            return
        role = fault.target
        when = f"at queued + {scenario.fault_after_s(fault):g} s: "
        cur = self.current
        if isinstance(fault, KillFault):
            self.add_all(self.host(role), phase, kill.plan_commands(role, fault.signal, fault.scope), when)
            if fault.restart_after_s is not None:
                self.start_server(cur["servers"]["decode"], "decode", phase, f"{fault.restart_after_s:g} s later, restart (same ports)")
                self.ready(cur["servers"]["decode"], "decode", phase)
            elif role == "decode":
                cur["decode_dead"] = True
        elif isinstance(fault, StallFault) and fault.method in CONNECTOR_STALLS:
            key, what = (("forward_stall_s", "forward-pass stall") if fault.method == "forward_pass"
                         else ("writer_stall_s", "push writer stall (before its next WRITE)"))
            self.add(self.host(role), phase, f"{when}ask {role}'s connector for a {fault.duration_s:g} s {what}",
                     write=str(cur["pairs"][role].fault_file(role)), content=json.dumps({key: fault.duration_s, "seq": SEQ}))
        elif isinstance(fault, StallFault):
            backend, root = _freezer_where(self.dep.is_local(self.host(role)))
            self.add_all(self.host(role), phase, stall.plan_commands(role, fault.method, fault.duration_s, backend=backend, root=root), when)
        elif isinstance(fault, HeartbeatFault):
            control = {"heartbeats": {"drop_next": fault.drop_next, "drop_fraction": fault.drop_fraction, "delay_s": fault.delay_s,
                                      "duplicate": fault.duplicate, "delay_next_s": fault.delay_next_s}, "seq": SEQ}
            path = str(cur["pairs"]["decode"].fault_file("decode"))
            self.add(self.host("decode"), phase, f"{when}heartbeat faults in D's connector", write=path, content=json.dumps(control))
            if fault.duration_s:
                self.add(self.host("decode"), phase, f"{fault.duration_s:g} s later, end them", write=path, content=json.dumps({"seq": SEQ}))
        elif isinstance(fault, PartitionFault):
            when = "before the first request: " if fault.first_handshake else when
            if cur["testbed"] is None:  # P and D on two other hosts: nft on the target's own host
                self.add_all(self.host(role), phase, host_partition_commands(self.dep, cur["pairs"][role], fault), when)
            else:
                self.add_all(LOCAL, phase, partition_commands(cur["pairs"][role], fault), when)


def _freezer_where(local: bool) -> tuple[str, str]:
    """The freezer hierarchy a stall would use: this machine's mounts, else cgroup v2 at /sys/fs/cgroup."""
    roots = hierarchy_roots() if local else {}
    backend = "v2" if "v2" in roots or "v1" not in roots else "v1"
    return backend, str(roots.get(backend, "/sys/fs/cgroup"))


def partition_commands(pair, fault: PartitionFault) -> list[dict]:
    """The nftables commands of a partition fault on a (planned) pair whose P and D run on the two
    hosts of a testbed, from :func:`leasekit.chaos.faults.netns.partition_plan`, as plan steps: add the
    rules in the target's host namespace, wait, read their packet counters, delete them."""
    from leasekit.chaos.faults.netns import partition_plan

    planned = partition_plan(fault, pair=pair)
    nft = ["ip", "netns", "exec", planned.namespace, "nft"]
    return [
        {"argv": [*nft, "--echo", "--handle", "-f", "-"], "stdin": planned.script(), "what": planned.description},
        {"argv": ["sleep", f"{fault.duration_s:g}"], "what": "the partition (later faults run meanwhile)"},
        {"argv": [*nft, "-a", "list", "table", "inet", "leasekit"], "what": "read the rules' packet counters (proof they matched)"},
        *({"argv": [*nft, "delete", "rule", "inet", "leasekit", rule.chain, "handle", f"<handle of rule {i + 1}>"],
           "what": "lift the partition"} for i, rule in enumerate(planned.rules)),
    ]


def host_partition_commands(deployment: PairFile, pair, fault: PartitionFault) -> list[dict]:
    """The commands of a partition fault on a (planned) pair whose P and D run on two other hosts of
    ``deployment``, as plan steps on the target's host, as the run does it
    (:class:`leasekit.chaos.faults.onhost.HostPartitionInjector`): ``nft`` in the host's own network stack,
    an ``accept`` for the host's SSH port at the head of each chain first (the controller's SSH connection
    carries the host agent's heartbeat), the rules naming the peer host's address, the wait, the packet
    counters, then the rules and the SSH guards removed.

    Raises:
        ValueError: P or D runs on this machine (a partition needs P and D on two other hosts, or
            ``launch.network_namespace`` on one machine), or the fault's fields are invalid.
    """
    from leasekit.chaos.faults.partition import PartitionSite, partition_plan

    names = {role: deployment.role(role).host for role in ROLES}
    local = [role for role in ROLES if deployment.is_local(names[role])]
    if local:
        raise ValueError(f"a partition needs P and D on two hosts, but {' and '.join(local)} run(s) on this machine "
                         f"(host {names[local[0]]!r}); fix: put [prefill] and [decode] on two [hosts] reachable over SSH, "
                         "or both on this machine (the scenario's network namespaces then make the two hosts)")

    def port(role: str, kind: str) -> int | str:
        return getattr(getattr(pair, role), f"{kind}_port") or f"<{role} {kind.replace('_', '-')} port>"

    site = PartitionSite(deployment.host(names["prefill"]).address, deployment.host(names["decode"]).address,
                         f"host {names['prefill']}", f"host {names['decode']}", port("prefill", "side_channel"),
                         port("decode", "side_channel"), port("prefill", "http"), port("decode", "http"))
    planned = partition_plan(fault, site=site)
    ssh_port = deployment.host(names[fault.target]).ssh_port
    chains = sorted({rule.chain for rule in planned.rules})
    setup = "add table inet leasekit\n" + "".join(
        f"add chain inet leasekit {c} {{ type filter hook {c} priority 0; policy accept; }}\n" for c in chains)
    guards = [{"argv": ["nft", "--echo", "--handle", "insert", "rule", "inet", "leasekit", chain, "tcp",
                        "dport" if chain == "input" else "sport", str(ssh_port), "accept"],
               "what": f"keep the SSH port {ssh_port} out of the partition ({chain})"} for chain in chains]
    return [
        {"argv": ["nft", "-f", "-"], "stdin": setup, "what": f"{planned.description}: the table and chains"},
        *guards,
        {"argv": ["nft", "--echo", "--handle", "-f", "-"], "stdin": "".join(r.text() + "\n" for r in planned.rules),
         "what": "the partition's rules"},
        {"argv": ["sleep", f"{fault.duration_s:g}"], "what": "the partition (later faults run meanwhile)"},
        {"argv": ["nft", "-a", "list", "table", "inet", "leasekit"], "what": "read the rules' packet counters (proof they matched)"},
        *({"argv": ["nft", "delete", "rule", "inet", "leasekit", rule.chain, "handle", f"<handle of rule {i + 1}>"],
           "what": "lift the partition"} for i, rule in enumerate(planned.rules)),
        *({"argv": ["nft", "delete", "rule", "inet", "leasekit", chain, "handle", f"<handle of the SSH guard in {chain}>"],
           "what": "remove the SSH guard"} for chain in chains),
    ]


def build_plan(runs: list[tuple[Scenario, str]], deployment: PairFile | None, run_dir: str | Path) -> Plan:
    """The plan of a suite over ``runs`` (in run order, see :func:`leasekit.chaos.suite.plan`) with
    ``deployment`` (None: the CPU default), whose reports would go to ``run_dir``. Executes nothing
    and creates nothing.

    Raises:
        ValueError: a fault or launch condition out of range, or a partition on a pair whose P and D
            cannot be parted (as the run would); ``leasekit chaos run --plan`` prints it and exits 2.
    """
    from leasekit.chaos.suite import _needs_pair

    planner = _Planner(deployment, Path(run_dir).absolute())
    deployment, run_dir = planner.dep, planner.run_dir
    hosts = {LOCAL: {"where": "this machine (runs leasekit: HTTP requests, reports)", "address": "127.0.0.1", "this_machine": True}}
    for role in ROLES:
        name = deployment.role(role).host
        host = deployment.host(name)
        local = deployment.is_local(name)
        hosts[name] = {"where": f"this machine ({host.address})" if local else f"{host.user}@{host.address}:{host.ssh_port} over SSH",
                       "address": host.address, "this_machine": local,
                       **({} if local else {"ssh": {"user": host.user, "port": host.ssh_port, "identity_file": host.identity_file}})}
    tools = tools_needed(runs)
    for role in ROLES:
        for what, argv in role_commands(deployment, role, tools[role]):
            planner.add(deployment.role(role).host, "preflight (before any server starts)", f"{role}: check {what}", argv=argv)
    for scenario, target in runs:
        planner.scenario(scenario, target, _needs_pair(scenario, target))
    planner.stop_pair("teardown")
    planner.add(LOCAL, "teardown", "remove leftover network namespaces lk-* and cgroups leasekit-* of this run, if any; write report.json and junit.xml")
    notes = ["pairs for later scenarios, and spare Ds, may be started ahead in the background (SCHED_BATCH, nice 10) "
             "with the same commands; a ready spare is held with SIGSTOP until used"]
    if deployment.remote_roles():
        notes.append("remote hosts are driven over SSH; their commands run in the host's run directory under its workdir")
        if any(s.launch.network_namespace for s, _ in runs):
            notes.append("P and D are on two hosts already: no network namespaces are made; a partition's nftables "
                         "rules run on the target's host, with that host's SSH port kept out of them")
    return Plan(str(run_dir), hosts, planner.steps, notes)
