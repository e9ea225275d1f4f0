"""A P/D pair runs one vLLM release: check_pair_releases and ``leasekit lint --prefill-vllm/--decode-vllm``."""

import argparse
import json

import pytest

from leasekit.lease.releases import (
    NIXL_CONNECTOR_VERSIONS,
    SUPPORTED_VLLM_RELEASES,
    VllmPairError,
    check_pair_releases,
    pair_release_problems,
)
from leasekit.runbook import lint


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.33.0+cu130", " 0.32.0\n"])
def test_same_release_on_both_sides_passes(version):
    check_pair_releases(version, version)
    assert pair_release_problems(version, version) == []


@pytest.mark.parametrize("prefill, decode", [("0.32.0", "0.33.0"), ("0.33.0", "0.32.0")])
def test_mixed_032_033_pair_is_refused_naming_both_versions_and_the_fix(prefill, decode):
    with pytest.raises(VllmPairError) as info:
        check_pair_releases(prefill, decode)
    message = str(info.value)
    assert f"prefill (P) runs vLLM {prefill}" in message and f"decode (D) runs vLLM {decode}" in message
    p_conn, d_conn = NIXL_CONNECTOR_VERSIONS[prefill], NIXL_CONNECTOR_VERSIONS[decode]
    assert f"NIXL_CONNECTOR_VERSION {p_conn} vs {d_conn}" in message
    assert "fix: run one release on both hosts" in message and "pip install vllm==0.33.0" in message
    (problem,) = info.value.problems
    assert problem[0] == "prefill_version/decode_version"


def test_same_release_with_another_local_part_is_refused():
    """vLLM's compatibility hash covers the whole __version__ string."""
    (problem,) = pair_release_problems("0.33.0", "0.33.0+cu130")
    assert "whole vllm.__version__ string" in problem[1] and "same build of vLLM 0.33.0" in problem[2]


def test_unsupported_release_names_the_side_unless_not_required():
    problems = pair_release_problems("0.31.0", "0.33.0")
    assert [p[0] for p in problems] == ["prefill_version"]
    assert "vLLM 0.31.0 is not a release LeaseKit supports" in problems[0][1]
    assert all(r in problems[0][1] for r in SUPPORTED_VLLM_RELEASES)
    (mixed,) = pair_release_problems("0.31.0", "0.33.0", require_supported=False)
    assert mixed[0] == "prefill_version/decode_version" and "0.31.0" in mixed[1]
    check_pair_releases("0.31.0", "0.31.0", require_supported=False)


@pytest.mark.parametrize("bad", ["", "   ", None, 32, "0.32 .0"])
def test_a_value_that_is_not_a_version_is_refused_with_the_field(bad):
    with pytest.raises(VllmPairError) as info:
        check_pair_releases("0.33.0", bad)
    assert info.value.problems[0][0] == "decode_version"
    assert "is not a vLLM version" in str(info.value) and "print(vllm.__version__)" in str(info.value)
    assert isinstance(info.value, ValueError)


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="leasekit")
    lint.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_lint_refuses_a_mixed_pair(capsys):
    assert run_cli(["lint", "--prefill-vllm", "0.32.0", "--decode-vllm", "0.33.0", "-o", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    (finding,) = report["findings"]
    assert finding["field"] == "prefill_vllm/decode_vllm" and finding["severity"] == "error"
    assert "0.32.0" in finding["message"] and "0.33.0" in finding["message"] and finding["fix"]
    assert report["timing"] is None
    assert run_cli(["lint", "--prefill-vllm", "0.32.0", "--decode-vllm", "0.33.0"]) == 1
    out = capsys.readouterr().out
    assert "mixed vLLM pair" in out and "FAIL: 1 error(s)" in out


def test_lint_passes_a_matching_pair_with_a_config(capsys):
    cfg = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                      "kv_connector_extra_config": {"kv_lease_duration": 30}})
    argv = ["lint", "--kv-transfer-config", cfg, "--prefill-vllm", "0.33.0", "--decode-vllm", "0.33.0", "-o", "json"]
    assert run_cli(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["findings"] == [] and report["timing"]["lease_duration_s"] == 30


def test_lint_adds_pair_findings_to_config_findings(capsys):
    cfg = '{"kv_connector_extra_config": {"kv_lease_duration": 30}}'  # no kv_role: an error
    assert run_cli(["lint", "--kv-transfer-config", cfg, "--prefill-vllm", "0.30.0", "--decode-vllm", "0.33.0",
                    "-o", "json"]) == 1
    fields = [f["field"] for f in json.loads(capsys.readouterr().out)["findings"]]
    assert fields == ["kv_role", "prefill_vllm"]


def test_lint_needs_both_versions(capsys):
    assert run_cli(["lint", "--prefill-vllm", "0.33.0"]) == 2
    assert "--decode-vllm: missing" in capsys.readouterr().err
    assert run_cli(["lint", "--decode-vllm", "0.33.0"]) == 2
    assert "--prefill-vllm: missing" in capsys.readouterr().err
