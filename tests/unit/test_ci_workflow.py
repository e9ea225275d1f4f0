"""ci/gpu-chaos.yml, validated offline (it cannot run here: no GPU): the GitHub-workflow JSON schema
(check-jsonschema's vendored copy), its shell steps parse, every matrix deployment is a pair file
that loads with GPUs on both sides, and every leasekit option it uses exists (``--help``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from leasekit.cluster.pairfile import load_pair_file
from leasekit.lease.releases import SUPPORTED_VLLM_RELEASES

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / "ci" / "gpu-chaos.yml"
EXPRESSION = re.compile(r"\$\{\{.*?\}\}")


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


@pytest.fixture(scope="module")
def job(workflow) -> dict:
    (only,) = workflow["jobs"].values()
    return only


def run_scripts(job) -> list[str]:
    return [step["run"] for step in job["steps"] if "run" in step]


def test_matches_the_github_workflow_schema():
    tool = Path(sys.executable).parent / "check-jsonschema"
    assert tool.exists(), "check-jsonschema is missing: pip install -e '.[dev]'"
    done = subprocess.run([str(tool), "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok -- validation done" in done.stdout


def test_shell_steps_parse(job):
    assert job["defaults"]["run"]["shell"] == "bash"  # GitHub runs `bash -eo pipefail` only when named
    for script in run_scripts(job):
        done = subprocess.run(["bash", "-n"], input=EXPRESSION.sub("X", script), capture_output=True, text=True)
        assert done.returncode == 0, f"{done.stderr}\n--- in ---\n{script}"


def test_matrix_deployments_are_gpu_pair_files_that_load(job):
    matrix = job["strategy"]["matrix"]
    assert matrix["lease"] == [6, 30]
    runners = {entry["deployment"]: entry["runner"] for entry in matrix["include"]}
    assert set(matrix["deployment"]) == set(runners) == {"gpu-one-node", "gpu-two-hosts"}
    for deployment in matrix["deployment"]:
        path = ROOT / "pairs" / f"{deployment}.toml"
        pair = load_pair_file(path)  # raises PairFileError naming the field
        for role in ("prefill", "decode"):
            assert pair.role(role).device == "cuda", f"{path}: {role}.device"
    assert load_pair_file(ROOT / "pairs" / "gpu-two-hosts.toml").remote_roles() == ["prefill", "decode"]
    assert "format('pairs/{0}.toml', matrix.deployment)" in job["env"]["PAIR"]
    inputs = next(v for k, v in yaml.safe_load(WORKFLOW.read_text()).items() if k in ("on", True))
    assert (ROOT / inputs["workflow_dispatch"]["inputs"]["two_hosts_pair"]["default"]).is_file()


def test_installs_the_newest_supported_vllm_and_uploads_every_cell(job):
    assert job["env"]["VLLM_SPEC"] == f"vllm=={SUPPORTED_VLLM_RELEASES[-1]}" == "vllm==0.33.0"
    assert job["env"]["RUN_DIR"].startswith("runs/gpu/")
    (upload,) = [s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@")]
    assert upload["if"] == "always()" and upload["with"]["path"] == "runs/gpu/"
    assert "matrix.deployment" in upload["with"]["name"] and "matrix.lease" in upload["with"]["name"]
    text = WORKFLOW.read_text()
    assert "never run on a GPU" in text  # the honesty note stays


def _leasekit_calls(job) -> list[list[str]]:
    calls = []
    for script in run_scripts(job):
        for line in script.replace("\\\n", " ").splitlines():
            for part in re.split(r"[|;&]", line):
                words = part.split()
                if words and words[0].endswith("bin/leasekit"):
                    calls.append(words[1:])
    return calls


def _help_options(command: list[str]) -> set[str]:
    done = subprocess.run([sys.executable, "-m", "leasekit.cli", *command, "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", done.stdout))


def test_every_leasekit_option_used_exists(job):
    calls = _leasekit_calls(job)
    commands = {tuple(w for w in c[:2] if not w.startswith("-")) for c in calls}
    assert commands == {("lint",), ("chaos", "run")}
    runs = [c for c in calls if c[:2] == ["chaos", "run"]]
    assert any("--plan" not in c for c in runs), "the catalog itself must run, not only its plan"
    for call in runs:
        assert {"--all", "--pair", "--lease-duration"} <= set(call), call
    for command in commands:
        known = _help_options(list(command))
        used = {w for c in calls if tuple(c[:len(command)]) == command for w in c if w.startswith("--")}
        assert used <= known, f"leasekit {' '.join(command)}: unknown {sorted(used - known)}"


@pytest.mark.parametrize("name", ["gpu-one-node", "gpu-two-hosts", "cpu-local"])
def test_pair_hosts_lists_each_role_for_the_shell(name):
    done = subprocess.run([sys.executable, str(ROOT / "ci" / "pair_hosts.py"), str(ROOT / "pairs" / f"{name}.toml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = [line.split("\t") for line in done.stdout.splitlines()]
    assert [r[0] for r in rows] == ["prefill", "decode"]
    assert all(len(r) == 8 and all(r) for r in rows)
    kinds = {r[2] for r in rows}
    assert kinds == ({"ssh"} if name == "gpu-two-hosts" else {"local"})
    if name == "gpu-two-hosts":
        assert rows[0][3] == "root@10.0.0.11" and rows[0][6] == "/opt/leasekit/.venv/bin/python"


def test_pair_hosts_refuses_a_bad_pair_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[prefill]\ndevice = "tpu"\n')
    done = subprocess.run([sys.executable, str(ROOT / "ci" / "pair_hosts.py"), str(bad)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "prefill.device" in done.stderr
