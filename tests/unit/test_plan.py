"""``leasekit chaos run --plan``: server lines are the run's own (the CPU default unchanged, the GPU
examples with their devices, TP and model), faults sit on the host holding their target, and nothing
is executed; ``leasekit chaos list`` keeps names whole in a pipe."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from leasekit.chaos.faults import kill, stall
from leasekit.chaos.plan import build_plan
from leasekit.chaos.pool import pair_spec
from leasekit.chaos.scenario import find_scenario
from leasekit.chaos.suite import plan as run_order
from leasekit.cli import main
from leasekit.cluster.pair import PairSpec, PDPair
from leasekit.cluster.pairfile import load_pair_file
from leasekit.cluster.server import VllmServer
from leasekit.cluster.serverspec import ServerSpec
from tests.unit.test_pairfile import without_ssh_support

PAIRS = Path(__file__).resolve().parents[2] / "pairs"
pytest_plugins = ["pytester"]


def steps(plan, host, text):
    return [s for s in plan.by_host()[host] if text in s.what]


def argv_of(plan, host, role):
    (step,) = [s for s in plan.by_host()[host] if s.what.startswith(f"start {role} ")][:1]
    return step


def test_default_command_line_is_unchanged(tmp_path):
    server = VllmServer(ServerSpec(name="prefill", role="prefill", connector="stock", model_dir=tmp_path, cpu=0), tmp_path)
    server.http_port, server.side_channel_port = 8100, 5600
    config = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"kv_lease_duration": 30}})
    assert server.command() == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path),
        "--served-model-name", "leasekit-tiny", "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
        "--dtype", "float32", "--kv-cache-memory-bytes", str(64 * 1024 * 1024), "--max-model-len", "4096",
        "--max-num-seqs", "8", "--host", "127.0.0.1", "--port", "8100", "--kv-transfer-config", config]
    assert server.launch_environment() == {
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600", "LEASEKIT_RUN_DIR": str(tmp_path), "VLLM_CPU_OMP_THREADS_BIND": "0"}


def test_cpu_local_pair_file_runs_the_default_pair(tmp_path):
    scenario = find_scenario("kill-decode")
    default = PDPair(pair_spec(scenario, "leasekit"), tmp_path / "a")  # builds servers, starts nothing
    filed = PDPair(pair_spec(scenario, "leasekit", load_pair_file(PAIRS / "cpu-local.toml")), tmp_path / "a")
    for role in ("prefill", "decode"):
        a, b = getattr(default, role), getattr(filed, role)
        assert a.command() == b.command() and a.environment() == b.environment() and a.python == b.python


def test_cpu_local_plan_is_the_real_command_line(tmp_path):
    scenario = find_scenario("kill-decode")
    plan = build_plan([(scenario, "leasekit")], load_pair_file(PAIRS / "cpu-local.toml"), tmp_path)
    real = PDPair(pair_spec(scenario, "leasekit"), tmp_path / "pairs" / "01-leasekit")
    for role in ("prefill", "decode"):
        server = getattr(real, role)
        server.http_port, server.side_channel_port = (f"<free {role} http port>", f"<free {role} side channel port>")
        step = argv_of(plan, "local", role)
        assert step.argv == server.command() and step.env == server.launch_environment()
        assert step.pin == server.spec.cpu_list() and step.cwd == str(real.run_dir)
    assert [s.argv for s in steps(plan, "local", "SIGKILL to decode's whole process group")] == [["kill", "-KILL", "--", "-<pgid of decode>"]]


def test_gpu_one_node_plan(tmp_path):
    runs = run_order([find_scenario("kill-decode"), find_scenario("stall-prefill-long")], ["leasekit"])
    plan = build_plan(runs, load_pair_file(PAIRS / "gpu-one-node.toml"), tmp_path)
    for role, gpu in (("prefill", "0"), ("decode", "1")):
        step = argv_of(plan, "local", role)
        assert step.env["CUDA_VISIBLE_DEVICES"] == gpu and step.env["HF_HUB_OFFLINE"] == "1"
        argv = step.argv
        assert argv[argv.index("--model") + 1] == "Qwen/Qwen2.5-0.5B-Instruct"
        assert argv[argv.index("--tensor-parallel-size") + 1] == "1" and argv[argv.index("--load-format") + 1] == "auto"
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.5" and argv[argv.index("--dtype") + 1] == "bfloat16"
        assert "dummy" not in argv and "--skip-tokenizer-init" not in argv and "--kv-cache-memory-bytes" not in argv
        assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_buffer_device"] == "cuda"
        assert step.pin is None and "VLLM_CPU_OMP_THREADS_BIND" not in step.env
    assert [s.argv for s in plan.by_host()["local"] if s.phase == "preflight (before any server starts)" and "gpus" in s.what] \
        == [["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]] * 2
    assert steps(plan, "local", "kill -STOP") == [] and steps(plan, "local", "stop every process of prefill")


def test_gpu_two_hosts_plan_puts_each_command_on_its_host(tmp_path):
    runs = run_order([find_scenario(n) for n in ("kill-decode", "stall-prefill-long", "fp-stall-decode")], ["leasekit"])
    plan = build_plan(runs, load_pair_file(PAIRS / "gpu-two-hosts.toml"), tmp_path)
    hosts = plan.by_host()
    assert set(hosts) == {"local", "gpu-a", "gpu-b"} and plan.hosts["gpu-a"]["ssh"]["port"] == 22
    p, d = argv_of(plan, "gpu-a", "prefill"), argv_of(plan, "gpu-b", "decode")
    assert p.argv[0] == "/opt/leasekit/.venv/bin/python" and p.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert p.argv[p.argv.index("--tensor-parallel-size") + 1] == "2" and d.argv[d.argv.index("--tensor-parallel-size") + 1] == "1"
    assert p.argv[p.argv.index("--model") + 1] == "/models/Qwen2.5-0.5B-Instruct" and "HF_HUB_OFFLINE" not in p.env
    assert p.argv[p.argv.index("--host") + 1] == "0.0.0.0" and p.argv[p.argv.index("--port") + 1] == "8100"
    assert p.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.11" and p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert p.cwd.startswith("/var/tmp/leasekit/") and p.env["LEASEKIT_RUN_DIR"] == p.cwd
    assert not any(s.what.startswith("start decode") for s in hosts["gpu-a"])
    assert steps(plan, "gpu-b", "SIGKILL to decode's whole process group") and not steps(plan, "gpu-a", "SIGKILL to decode")
    assert steps(plan, "gpu-a", "stop every process of prefill") and not steps(plan, "gpu-b", "stop every process of prefill")
    (stall_write,) = steps(plan, "gpu-b", "forward-pass stall")
    assert stall_write.write.startswith("/var/tmp/leasekit/") and json.loads(stall_write.content)["forward_stall_s"] == 2
    assert all(s.argv is None and s.write is None for s in hosts["local"])  # only HTTP from this machine


def test_plan_executes_nothing_and_covers_launch_faults(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError(f"the plan tried to execute {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the faketime shim is not built yet
    run_dir = tmp_path / "run"
    argv = ["chaos", "run", "handshake-partition", "skew-monotonic", "wall-clock-jump", "stall-decode-long",
            "--target", "leasekit", "--plan", "--run-dir", str(run_dir), "-o", "json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["executed"] is False and not run_dir.exists() and not (tmp_path / "cache").exists()
    local = plan["hosts"]["local"]["steps"]
    text = json.dumps(local)
    assert any(s.get("argv", [])[:3] == ["ip", "netns", "add"] for s in local)  # the hosts' namespaces
    assert any(s.get("argv", [])[:3] == ["ip", "netns", "exec"] and "nft" in s["argv"] and "counter drop" in s.get("stdin", "")
               for s in local)  # the partition's rules
    assert any("--monotonic=10000" in s.get("argv", []) for s in local)  # unshare prefix of the skewed server
    assert any(s.get("env", {}).get("FAKETIME") for s in local) and "sleepfix.c" in text  # faketime env + shim build
    assert "cgroup.freeze" in text or "freezer.state" in text


def test_plan_text_is_grouped_per_host(capsys):
    assert main(["chaos", "run", "kill-decode", "--pair", str(PAIRS / "gpu-two-hosts.toml"), "--plan", "--target", "leasekit"]) == 0
    out = capsys.readouterr().out
    a, b = out.index("==== host gpu-a: root@10.0.0.11:22 over SSH"), out.index("==== host gpu-b: root@10.0.0.12:22 over SSH")
    assert "--tensor-parallel-size 2" in out[a:b] and "kill -KILL -- '-<pgid of decode>'" in out[b:]


def test_remote_pair_without_plan_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch):
    without_ssh_support(monkeypatch)
    assert main(["chaos", "run", "kill-decode", "--pair", str(PAIRS / "gpu-two-hosts.toml"), "--run-dir", str(tmp_path / "r")]) == 2
    assert "needs SSH host support" in capsys.readouterr().err and not (tmp_path / "r").exists()
    bad = tmp_path / "bad.toml"
    bad.write_text('[decode]\ndevice = "gpu"\n')
    assert main(["chaos", "run", "kill-decode", "--pair", str(bad), "--plan"]) == 2
    assert "decode.device: Input should be 'cpu' or 'cuda'" in capsys.readouterr().err


def test_pair_file_lease_duration_and_its_override(capsys, tmp_path):
    pair = tmp_path / "l.toml"
    pair.write_text("lease_duration_s = 12\n[prefill]\n[decode]\n")
    assert main(["chaos", "run", "kill-decode", "--pair", str(pair), "--plan", "--target", "leasekit"]) == 0
    assert '"kv_lease_duration": 12' in capsys.readouterr().out
    assert main(["chaos", "run", "kill-decode", "--pair", str(pair), "--plan", "--target", "leasekit", "--lease-duration", "9"]) == 0
    assert '"kv_lease_duration": 9' in capsys.readouterr().out


def test_fault_plan_commands():
    assert kill.plan_commands("prefill", "SIGTERM") == [{"argv": ["kill", "-TERM", "--", "-<pgid of prefill>"],
                                                        "what": "SIGTERM to prefill's whole process group (API server, engine core, workers)"}]
    (core,) = kill.plan_commands("decode", "SIGKILL", "engine_core")
    assert core["argv"][:2] == ["kill", "-KILL"] and "VLLM::EngineCore" in core["argv"][2]
    sig = stall.plan_commands("decode", "sigstop", 8)
    assert [s["argv"][:2] for s in sig] == [["kill", "-STOP"], ["sleep", "8"], ["kill", "-CONT"]]
    v1 = stall.plan_commands("decode", "freezer", 3, backend="v1", root="/sys/fs/cgroup/freezer")
    assert {"write": "/sys/fs/cgroup/freezer/leasekit-<uuid>/freezer.state", "content": "FROZEN"}.items() <= \
        next(s for s in v1 if s.get("content") == "FROZEN").items()
    with pytest.raises(ValueError, match="method must be"):
        stall.plan_commands("decode", "forward_pass", 1)


def test_pair_spec_with_a_deployment_is_hashable():
    spec = PairSpec.pinned(deployment=load_pair_file(PAIRS / "gpu-one-node.toml"))
    assert {spec.launch_key(): 1}[PairSpec.pinned(deployment=load_pair_file(PAIRS / "gpu-one-node.toml")).launch_key()] == 1
    assert spec.launch_key() != PairSpec.pinned().launch_key()


def test_chaos_list_keeps_names_whole_in_a_pipe():
    listed = subprocess.run([sys.executable, "-m", "leasekit.cli", "chaos", "list"], capture_output=True, text=True, check=True)
    names = json.loads(subprocess.run([sys.executable, "-m", "leasekit.cli", "chaos", "list", "-o", "json"],
                                      capture_output=True, text=True, check=True).stdout)
    assert len(names) >= 14 and all("error" not in row for row in names)
    for row in names:
        assert f"│ {row['name']} " in listed.stdout, row["name"]
        assert set(row["expect"]) == set(row["targets"])


def test_chaos_list_prints_brackets_as_written(tmp_path):
    """A description or an error with ``[...]`` in it (TOML tables, regex classes) is text, not markup."""
    (tmp_path / "brackets.toml").write_text('name = "brackets"\ndescription = "Set [lease] duration_s, not [bold]x[/bold]"\n'
                                            'incident = "K08"\n[[faults]]\nkind = "none"\n[expect]\nchecks = ["liveness"]\n')
    (tmp_path / "Bad_Name.toml").write_text('name = "Bad_Name"\ndescription = "d"\nincident = "K08"\n[[faults]]\nkind = "none"\n'
                                            '[expect]\nchecks = ["liveness"]\n')
    done = subprocess.run([sys.executable, "-m", "leasekit.cli", "chaos", "list", "--catalog", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 2, done.stderr  # Bad_Name is invalid: listed, and the exit says so
    listed = done.stdout
    assert "Set [lease] duration_s, not [bold]x[/bold]" in listed
    assert "[a-z0-9]" in listed  # the name pattern in Bad_Name's error


def test_pytest_leasekit_pair_option(pytester, monkeypatch):
    without_ssh_support(monkeypatch)
    pytester.makepyfile("def test_case(chaos_case):\n    pass\n")
    bad = pytester.path / "bad.toml"
    bad.write_text('[prefill]\ncpus = "0"\n')
    refused = pytester.runpytest("--collect-only", f"--leasekit-pair={bad}")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["*--leasekit-pair: invalid pair file*", "*prefill.cpus: Input should be a valid list*"])
    remote = pytester.runpytest("--collect-only", f"--leasekit-pair={PAIRS / 'gpu-two-hosts.toml'}")
    assert remote.ret == pytest.ExitCode.USAGE_ERROR
    remote.stderr.fnmatch_lines(["*prefill.host = 'gpu-a' is another machine*needs SSH host support*"])
    local = pytester.runpytest("--collect-only", "-q", f"--leasekit-pair={PAIRS / 'cpu-local.toml'}", "--leasekit-scenario=kill-decode")
    assert local.ret == pytest.ExitCode.OK and any("kill-decode[leasekit]" in line for line in local.outlines)


@pytest.mark.parametrize("pair_file", sorted(PAIRS.glob("*.toml")), ids=lambda p: p.name)
def test_every_scenario_plans_on_every_example_pair_file(pair_file, capsys, tmp_path):
    # what ci/gpu-chaos.yml runs for each cell (text), and the same as data
    argv = ["chaos", "run", "--all", "--pair", str(pair_file), "--lease-duration", "6", "--run-dir", str(tmp_path / "r"), "--plan"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "==== host local" in capsys.readouterr().out
    assert main([*argv, "-o", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["executed"] is False and not (tmp_path / "r").exists()


def test_two_hosts_partition_runs_nft_on_the_target_host_with_the_ssh_port_kept_out(tmp_path):
    runs = run_order([find_scenario(n) for n in ("partition-long", "handshake-partition")], ["leasekit"])
    plan = build_plan(runs, load_pair_file(PAIRS / "gpu-two-hosts.toml"), tmp_path)
    every = [s for s in plan.steps if s.argv]
    assert not any(s.argv[:2] == ["ip", "netns"] for s in every)  # two real hosts: no namespaces anywhere
    assert not any("nft" in s.argv for s in plan.by_host()["local"] if s.argv)
    for scenario, _ in runs:
        (fault,) = scenario.faults
        host, peer = ("gpu-a", "10.0.0.12") if fault.target == "prefill" else ("gpu-b", "10.0.0.11")
        mine = [s for s in plan.by_host()[host] if s.phase.startswith(scenario.name) and s.argv and s.argv[0] == "nft"]
        guards = [s.argv for s in mine if "insert" in s.argv]
        assert guards and {(g[7], *g[9:]) for g in guards} <= {("input", "dport", "22", "accept"), ("output", "sport", "22", "accept")}
        (rules,) = [s for s in mine if s.stdin and "counter" in s.stdin]
        assert f"addr {peer}" in rules.stdin and " 22 " not in rules.stdin
        order = [s.what for s in mine]
        assert order.index(next(w for w in order if "SSH port" in w)) < order.index("the partition's rules")
        assert sum("lift the partition" in w for w in order) == rules.stdin.count("add rule")
        assert sum("remove the SSH guard" in w for w in order) == len(guards)
    assert any("SSH port kept out" in note for note in plan.notes)


def test_a_plan_that_cannot_be_made_is_a_message_not_a_traceback(capsys, monkeypatch):
    from leasekit.chaos import plan as plan_module
    from leasekit.chaos.faults import FaultError

    def refuse(*args):
        raise FaultError("a partition needs P and D on two hosts")

    monkeypatch.setattr(plan_module, "build_plan", refuse)
    assert main(["chaos", "run", "partition-long", "--plan"]) == 2
    err = capsys.readouterr().err
    assert "leasekit: cannot plan this run: a partition needs P and D on two hosts" in err and "Traceback" not in err


@pytest.mark.parametrize("hosts", [("local", "b"), ("b", "b")])
def test_a_partition_needs_p_and_d_on_two_separate_hosts_when_one_is_remote(tmp_path, capsys, hosts):
    """A namespace made on this machine cannot hold a server started over SSH: P here and D there,
    or both on one remote host, is refused with the fix (never a plan of `ip netns exec` over SSH)."""
    pair_path = tmp_path / "mixed.toml"
    pair_path.write_text('[hosts.local]\naddress = "10.0.0.5"\n[hosts.b]\naddress = "10.0.0.12"\npython = "/usr/bin/python3"\n'
                         f'[prefill]\nhost = "{hosts[0]}"\n[decode]\nhost = "{hosts[1]}"\n')
    assert main(["chaos", "run", "partition-long", "--plan", "--pair", str(pair_path), "--target", "leasekit"]) == 2
    err = capsys.readouterr().err
    assert f"runs P on {hosts[0]!r} and D on {hosts[1]!r}, not on two separate hosts" in err, err
    assert "fix: put [prefill] and [decode] on two different SSH hosts" in err and "Traceback" not in err
    assert main(["chaos", "run", "kill-decode", "--plan", "--pair", str(pair_path), "--target", "leasekit"]) == 0  # no partition: fine


def test_a_catalog_directory_that_is_not_there_is_refused_however_it_is_given(monkeypatch, capsys, tmp_path):
    missing = tmp_path / "nowhere"
    assert main(["chaos", "list", "--catalog", str(missing)]) == 2
    monkeypatch.setenv("LEASEKIT_CHAOS_DIR", str(missing))
    assert main(["chaos", "list"]) == 2
    assert main(["chaos", "run", "kill-decode", "--plan"]) == 2
    err = capsys.readouterr().err
    assert err.count(f"LEASEKIT_CHAOS_DIR={missing} is not a directory; fix:") == 2 and "Traceback" not in err
