"""``leasekit lint --kv-transfer-config``: findings of lint_kv_transfer_config, derived timing, exit codes."""

import argparse
import json

from leasekit.runbook import lint


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="leasekit")
    lint.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_good_config_exits_0_with_derived_timing(capsys):
    cfg = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                      "kv_connector_extra_config": {"kv_lease_duration": 30}})
    assert run_cli(["lint", "--kv-transfer-config", cfg, "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["findings"] == [] and report["errors"] == 0
    assert report["timing"] == {"lease_duration_s": 30, "heartbeat_interval_s": 5, "extension_s": 20,
                                "decoder_kv_blocks_ttl_s": 480, "safe_stall_s": 15.0, "heartbeat_loss_budget": 2}
    assert run_cli(["lint", "--kv-transfer-config", cfg]) == 0
    out = capsys.readouterr().out
    assert "no findings" in out and "derived: L=30 s, H=5 s, E=20 s" in out and "OK: 0 error(s)" in out


def test_warnings_alone_exit_0(capsys):
    cfg = '{"kv_role": "kv_consumer", "kv_connector_extra_config": {"kv_lease_duration": 5}}'
    assert run_cli(["lint", "--kv-transfer-config", cfg, "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (finding,) = report["findings"]
    assert finding["severity"] == "warning" and finding["field"] == "kv_connector_extra_config.kv_lease_duration"
    assert report["timing"]["heartbeat_interval_s"] == 0 and report["timing"]["heartbeat_loss_budget"] is None


def test_errors_exit_1_with_field_and_fix(capsys):
    cfg = '{"kv_connector_extra_config": {"kv_lease_duration": 1}}'  # no kv_role; L < 2 gives E = 0
    assert run_cli(["lint", "--kv-transfer-config", cfg, "-o", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["errors"] == 2
    fields = [(f["field"], f["severity"]) for f in report["findings"]]
    assert ("kv_role", "error") in fields and ("kv_connector_extra_config.kv_lease_duration", "error") in fields
    assert all(f["fix"] for f in report["findings"])
    assert report["timing"]["extension_s"] == 0  # the timing still parses and is shown
    assert run_cli(["lint", "--kv-transfer-config", cfg]) == 1
    out = capsys.readouterr().out
    assert "kv_lease_duration >= 6" in out and "FAIL: 2 error(s)" in out


def test_unparsable_lease_settings_show_no_timing(capsys):
    cfg = '{"kv_role": "kv_producer", "kv_connector_extra_config": {"kv_lease_duration": "30"}}'
    assert run_cli(["lint", "--kv-transfer-config", cfg, "-o", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["timing"] is None and "is not a number of seconds" in report["findings"][0]["message"]
    assert run_cli(["lint", "--kv-transfer-config", "{not json", "-o", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    (finding,) = report["findings"]
    assert finding["field"] == "kv_transfer_config" and "not valid JSON" in finding["message"]


def test_config_from_a_file(tmp_path, capsys):
    path = tmp_path / "kv.json"
    path.write_text('{"kv_role": "kv_both", "kv_connector_extra_config": {"kv_lease_duration": 12}}')
    assert run_cli(["lint", "--kv-transfer-config", f"@{path}", "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [f["message"] for f in report["findings"]] == ["kv_role='kv_both' is deprecated for NixlConnector"]
    assert report["timing"]["extension_s"] == 8


def test_usage_errors_exit_2(tmp_path, capsys):
    assert run_cli(["lint", "--kv-transfer-config", f"@{tmp_path / 'missing.json'}"]) == 2
    assert "cannot read the file" in capsys.readouterr().err
    assert run_cli(["lint"]) == 2  # nothing to lint
    assert "nothing to lint" in capsys.readouterr().err


def test_out_of_range_lease_duration_is_a_finding_not_a_crash(capsys):
    for value in (1e308, 3600.5, 10**400):  # 1e308 * 2 overflows: E would be nan
        cfg = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                          "kv_connector_extra_config": {"kv_lease_duration": value}})
        assert run_cli(["lint", "--kv-transfer-config", cfg, "-o", "json"]) == 1
        report = json.loads(capsys.readouterr().out)
        (finding,) = report["findings"]
        assert finding["field"] == "kv_connector_extra_config.kv_lease_duration" and finding["severity"] == "error"
        assert "0 < L <= 3600" in finding["message"] and "(0, 3600]" in finding["fix"] and report["timing"] is None
    cfg = '{"kv_role": "kv_producer", "kv_connector_extra_config": {"kv_lease_duration": 3600}}'
    assert run_cli(["lint", "--kv-transfer-config", cfg, "-o", "json"]) == 0  # the edge itself is fine
    assert json.loads(capsys.readouterr().out)["timing"]["heartbeat_loss_budget"] == 2


def test_misspelt_extra_config_key_names_the_closest_known_key(capsys):
    cfg = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                      "kv_connector_extra_config": {"kv_lease_duraton": 10, "decoder_kv_block_ttl": 60,
                                                    "some_other_setting": 1}})
    assert run_cli(["lint", "--kv-transfer-config", cfg, "-o", "json"]) == 0  # warnings only
    report = json.loads(capsys.readouterr().out)
    found = {f["field"]: f for f in report["findings"]}
    assert set(found) == {"kv_connector_extra_config.kv_lease_duraton", "kv_connector_extra_config.decoder_kv_block_ttl"}
    typo = found["kv_connector_extra_config.kv_lease_duraton"]
    assert typo["severity"] == "warning" and typo["fix"] == "did you mean kv_lease_duration?"
    assert "stays at its default 30" in typo["message"] and report["timing"]["lease_duration_s"] == 30
    assert found["kv_connector_extra_config.decoder_kv_block_ttl"]["fix"] == "did you mean decoder_kv_blocks_ttl?"
