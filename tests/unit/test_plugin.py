"""The leasekit pytest plugin, run in a throw-away pytest session (pytester): markers, the gpu skip,
catalog parametrisation in run order, and option errors. No pair is started here."""

import pytest

pytest_plugins = ["pytester"]

SCENARIO = """
name = "{name}"
description = "d"
incident = "K01"
[topology]
targets = {targets}
[[faults]]
kind = "{kind}"
[expect]
checks = ["all_served"]
"""


@pytest.fixture
def catalog(tmp_path):
    directory = tmp_path / "catalog"
    directory.mkdir()
    for name, kind, targets in (("b-kill", "kill", '["leasekit", "stock"]'), ("a-calm", "none", '["leasekit"]')):
        (directory / f"{name}.toml").write_text(SCENARIO.format(name=name, kind=kind, targets=targets))
    return directory


def test_catalog_is_parametrised_in_run_order(pytester, catalog):
    pytester.makepyfile(test_case="def test_case(chaos_case):\n    scenario, target = chaos_case\n    assert target in scenario.topology.targets\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--collect-only", "-q", f"--leasekit-catalog={catalog}")
    ids = [line for line in result.outlines if "::test_case[" in line]
    # per target; within one, scenarios that kill a server last
    assert ids == ["test_case.py::test_case[a-calm[leasekit]]", "test_case.py::test_case[b-kill[leasekit]]",
                   "test_case.py::test_case[b-kill[stock]]"], result.outlines
    only = pytester.runpytest("--collect-only", "-q", f"--leasekit-catalog={catalog}", "--leasekit-target=stock")
    assert [line for line in only.outlines if "::test_case[" in line] == ["test_case.py::test_case[b-kill[stock]]"]


def test_gpu_marker_skips_without_a_gpu(pytester, monkeypatch):
    monkeypatch.setattr("leasekit.chaos.plugin.gpu_available", lambda: False)
    pytester.makepyfile("import pytest\n@pytest.mark.gpu\ndef test_g():\n    assert False\n@pytest.mark.chaos\ndef test_c():\n    pass\n")
    result = pytester.runpytest_inprocess("--strict-markers", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*no NVIDIA GPU*"])


def test_bad_options_are_usage_errors(pytester, catalog):
    pytester.makepyfile("def test_case(chaos_case):\n    pass\n")
    half = pytester.runpytest(f"--leasekit-catalog={catalog}", "--leasekit-prefill-url=http://127.0.0.1:1")
    assert half.ret == pytest.ExitCode.USAGE_ERROR
    half.stderr.fnmatch_lines(["*--leasekit-prefill-url and --leasekit-decode-url go together*"])
    unknown = pytester.runpytest(f"--leasekit-catalog={catalog}", "--leasekit-scenario=nope")
    assert unknown.ret == pytest.ExitCode.INTERRUPTED  # a collection error names the scenario
    unknown.stdout.fnmatch_lines(["*unknown scenario 'nope'; known: a-calm, b-kill*"])
    bad_l = pytester.runpytest(f"--leasekit-catalog={catalog}", "--leasekit-lease-duration=-1")
    assert bad_l.ret == pytest.ExitCode.USAGE_ERROR
    bad_l.stderr.fnmatch_lines(["*--leasekit-lease-duration must satisfy 0 < seconds <= 3600*"])


def test_external_pair_runs_only_what_it_can(pytester, catalog, tmp_path):
    """With URLs, the stock-only case list follows --leasekit-pair-target, and a kill scenario is
    skipped with the reason (no server answers: nothing may be started or contacted for it)."""
    pytester.makepyfile(
        "from leasekit.chaos.plugin import run_case\n"
        "def test_case(leasekit_suite, chaos_case):\n    r = run_case(leasekit_suite, *chaos_case)\n    assert not r.summary.startswith('harness error'), r.summary\n")
    result = pytester.runpytest_inprocess(
        f"--leasekit-catalog={catalog}", "--leasekit-prefill-url=http://127.0.0.1:9", "--leasekit-decode-url=http://127.0.0.1:9",
        f"--leasekit-pair-dir={tmp_path / 'pair'}", f"--leasekit-run-dir={tmp_path / 'run'}", "-rs", "--leasekit-lease-duration=6")
    result.assert_outcomes(skipped=1, failed=1)  # b-kill skipped; a-calm tries the (dead) pair
    result.stdout.fnmatch_lines(["*b-kill: a kill fault*needs the processes of a pair leasekit started*"])


def test_the_suite_plans_only_the_selected_cases(pytester, catalog, tmp_path):
    """``-k`` (or a hook that deselects) leaves cases out: the suite's plan, which decides the pairs
    started ahead in the background, holds only what will run, in run order."""
    pytester.makepyfile(
        "def test_case(leasekit_suite, chaos_case):\n"
        "    assert [(s.name, t) for s, t in leasekit_suite.runs] == [('b-kill', 'leasekit'), ('b-kill', 'stock')]\n")
    result = pytester.runpytest_inprocess(f"--leasekit-catalog={catalog}", f"--leasekit-run-dir={tmp_path / 'run'}",
                                          "-k", "b-kill", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, deselected=1)
