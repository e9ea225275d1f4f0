"""The leasekit command line (commands that need no pair)."""

import json

import pytest

from leasekit.cli import main


def test_bounds_json(capsys):
    assert main(["bounds", "--lease-duration", "30", "--tick", "0.1", "-o", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["heartbeat_interval_s"] == 5 and data["extension_s"] == 20
    assert data["safe_stall_s"] == 15.0 and data["heartbeat_loss_budget"] == 2
    assert data["reclaim_after_silence_worst_case_s"] == pytest.approx(30.1)


def test_bounds_below_six_seconds_explains_the_budget(capsys):
    assert main(["bounds", "--lease-duration", "5", "-o", "json"]) == 0
    assert "undefined" in json.loads(capsys.readouterr().out)["heartbeat_loss_budget"]


def test_bad_lease_duration_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bounds", "--lease-duration", "-3"])
    assert info.value.code == 2
    assert "must satisfy 0 < seconds <= 3600" in capsys.readouterr().err


def test_chaos_list_and_unknown_scenario(capsys):
    assert main(["chaos", "list"]) == 0
    assert "kill-decode" in capsys.readouterr().out
    assert main(["chaos", "run", "no-such-scenario"]) == 2
    err = capsys.readouterr().err
    assert "known:" in err and "kill-decode" in err and "stall-decode-long" in err
    assert main(["chaos", "run"]) == 2
    assert "pass --all" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bounds", "--tick", "nan"], ["bounds", "--tick", "-1"], ["chaos", "run", "kill-decode", "--start-timeout", "-5"]])
def test_out_of_range_seconds_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and "must satisfy" in capsys.readouterr().err


def test_unusable_inputs_are_refused_before_anything_starts(tmp_path, capsys):
    assert main(["chaos", "run", "kill-decode", "--run-dir", "/dev/null/x"]) == 2
    assert "not a writable directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["chaos", "run", "kill-decode", "--target", "vanilla"])
    assert info.value.code == 2 and "'leasekit', 'stock'" in capsys.readouterr().err
    only_leasekit = tmp_path / "only-leasekit.toml"
    only_leasekit.write_text('name = "only-leasekit"\ndescription = "d"\nincident = "K01"\n[topology]\n'
                             'targets = ["leasekit"]\n[[faults]]\nkind = "none"\n[expect]\nchecks = ["all_served"]\n')
    assert main(["chaos", "run", str(only_leasekit), "--target", "stock", "--run-dir", str(tmp_path / "r")]) == 2
    assert "none of the scenarios runs on target(s) stock" in capsys.readouterr().err
    binary = tmp_path / "b.toml"
    binary.write_bytes(b"\x00\xff\xfe")
    assert main(["chaos", "run", str(binary)]) == 2
    assert "not UTF-8" in capsys.readouterr().err


def test_bounds_lints_the_config_edges(capsys):
    assert main(["bounds", "--lease-duration", "1", "-o", "json"]) == 0
    lint = json.loads(capsys.readouterr().out)["lint"]
    assert any("heartbeats do nothing" in f for f in lint) and any("every engine step" in f for f in lint)


def test_output_without_plan_and_an_empty_catalog_are_usage_errors_that_start_nothing(tmp_path, capsys):
    assert main(["chaos", "run", "kill-decode", "-o", "json", "--run-dir", str(tmp_path / "run")]) == 2
    assert "--plan" in capsys.readouterr().err and not (tmp_path / "run").exists()
    assert main(["chaos", "run", "--all", "--catalog", str(tmp_path), "--plan"]) == 2
    assert f"no scenario files (*.toml) in {tmp_path}" in capsys.readouterr().err


def test_chaos_list_exits_2_when_a_catalog_file_is_invalid(tmp_path, capsys):
    import shutil

    from leasekit.chaos.scenario import catalog_dir

    shutil.copy(catalog_dir() / "kill-decode.toml", tmp_path / "kill-decode.toml")
    assert main(["chaos", "list", "--catalog", str(tmp_path), "-o", "json"]) == 0
    capsys.readouterr()
    (tmp_path / "broken.toml").write_text('name = "broken"\n[lease]\nduration_s = -1\n')
    assert main(["chaos", "list", "--catalog", str(tmp_path), "-o", "json"]) == 2
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert "error" in rows["broken"] and "error" not in rows["kill-decode"]


def test_a_pair_files_short_lease_is_linted_like_lease_duration(tmp_path, capsys):
    pair = tmp_path / "pair.toml"
    pair.write_text("lease_duration_s = 3\n[prefill]\n[decode]\n")
    assert main(["chaos", "run", "kill-decode", "--pair", str(pair), "--plan", "--run-dir", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "warning: the pair file's lease_duration_s = 3" in err and "resolved at L = 3 s" in err


@pytest.mark.parametrize("url", ["not a url", "ftp://x/runbook.md", "https://x/runbook.md#a", ""])
def test_dashboards_build_refuses_a_runbook_url_that_is_no_http_page(url, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["dashboards", "build", "--out", str(tmp_path), "--runbook-url", url])
    assert info.value.code == 2 and "http(s) URL" in capsys.readouterr().err
