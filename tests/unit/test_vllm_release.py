"""The vLLM-release axis of the conformance matrix: the pair file's ``vllm_release`` field, the release read
from a server's ``GET /version`` (against a small HTTP server started here on 127.0.0.1, standing in for
vLLM's endpoint), the refusal of a pair that reports another release than declared, the release in
report.json, JUnit and the terminal table, and several ``--pair`` files in one run (with a stand-in suite:
no vLLM server is started)."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from rich.console import Console

from leasekit.chaos.multipair import PairFileRuns, pair_run_dir
from leasekit.chaos.report import matrix_rows, matrix_table
from leasekit.chaos.result import ScenarioResult
from leasekit.chaos.scenario import find_scenario
from leasekit.chaos.suite import Suite
from leasekit.cli import _load_pairs, build_parser, main
from leasekit.cluster.pair import PDPair
from leasekit.cluster.pairfile import PairFileError, load_pair_file, parse_pair_file
from leasekit.cluster.vllmrelease import VllmReleaseMismatch, measure_pair, pair_label, read_release


def pair_file(**top) -> object:
    return parse_pair_file({**top, "prefill": {}, "decode": {}})


# -- the pair-file field ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0.33.0", "0.32.0", "0.34.0rc1", "0.33.1.post1", "0.34.0.dev12"])
def test_vllm_release_accepts_a_release(value):
    assert pair_file(vllm_release=value).vllm_release == value


def test_vllm_release_is_optional():
    assert pair_file().vllm_release is None


@pytest.mark.parametrize("value, fix", [
    ("0.33", "fix: e.g. vllm_release = '0.33.0'"),
    ("v0.33.0", "fix: e.g. vllm_release = '0.33.0'"),
    ("0.32.0+cpu", "fix: drop the local part: '0.32.0'"),
    ("", "fix: e.g. vllm_release = '0.33.0'"),
    ("0.33.0\n", "fix: e.g. vllm_release = '0.33.0'"),  # `$` would let a trailing newline through
])
def test_vllm_release_refuses_other_forms_naming_the_field_and_the_form(value, fix):
    with pytest.raises(PairFileError) as info:
        pair_file(vllm_release=value)
    text = str(info.value)
    assert f"vllm_release: {value!r} is not a vLLM release" in text
    assert "allowed: MAJOR.MINOR.PATCH" in text and fix in text


def test_vllm_release_must_be_a_quoted_string(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("vllm_release = 0.33\n[prefill]\n[decode]\n")
    with pytest.raises(PairFileError) as info:
        load_pair_file(path)
    assert "vllm_release: Input should be a valid string (got 0.33)" in str(info.value)
    assert "fix: a quoted release, e.g. vllm_release = '0.33.0'" in str(info.value)


# -- reading GET /version ----------------------------------------------------------------------------------
@contextmanager
def version_server(status: int = 200, body: bytes = b'{"version": "0.32.0"}', delay_s: float = 0.0,
                   trickle_s: float = 0.0):
    """An HTTP server on 127.0.0.1 answering ``GET /version`` with ``status`` and ``body`` after ``delay_s``
    seconds (404 elsewhere), the body one byte every ``trickle_s`` seconds when set (no Content-Length: the
    end of the body is the end of the connection); yields its base URL and the paths it was asked for."""
    asked: list[str] = []
    done = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            asked.append(self.path)
            time.sleep(delay_s)
            code = status if self.path == "/version" else 404
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            step = 1 if trickle_s else max(len(body), 1)
            try:
                for at in range(0, len(body), step):
                    if done.wait(trickle_s):
                        return
                    self.wfile.write(body[at:at + step])
            except OSError:  # the client gave up
                pass

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        done.set()
        server.shutdown()
        server.server_close()


def test_read_release_drops_the_local_part():
    with version_server(body=b'{"version": "0.33.0+cu129"}') as (url, asked):
        assert read_release(url + "/") == "0.33.0"
    assert asked == ["/version"]  # once


@pytest.mark.parametrize("status, body", [
    (500, b'{"version": "0.32.0"}'),
    (200, b"not json"),
    (200, b'{"version": 32}'),
    (200, b'["0.32.0"]'),
    (200, b'{"version": "0.32.0 with spaces"}'),
    (200, b"{}"),
])
def test_an_unreadable_version_is_unknown(status, body):
    with version_server(status, body) as (url, _):
        assert read_release(url) == "unknown"


def test_no_answer_in_time_or_no_server_is_unknown():
    with version_server(delay_s=1.0) as (url, _):
        started = time.monotonic()
        assert read_release(url, timeout_s=0.2) == "unknown"
        assert time.monotonic() - started < 0.9
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert read_release(f"http://127.0.0.1:{port}", timeout_s=0.5) == "unknown"  # nothing listens there


def test_a_trickling_version_is_unknown_at_the_total_deadline():
    body = b'{"version": "0.32.0", "pad": "' + b"x" * 100 + b'"}'  # a byte per 20 ms: 2.6 s, each read fast
    with version_server(body=body, trickle_s=0.02) as (url, _):
        started = time.monotonic()
        assert read_release(url, timeout_s=0.5) == "unknown"
        assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("pad, release", [(60_000, "0.32.0"), (70_000, "unknown")])
def test_a_version_body_over_64_kib_is_unknown(pad, release):
    with version_server(body=b'{"version": "0.32.0", "pad": "' + b"x" * pad + b'"}') as (url, _):
        assert read_release(url) == release


def test_a_restarted_d_is_read_alone_and_an_unreadable_one_keeps_the_known_release():
    with version_server() as (p, p_asked), version_server(body=b'{"version": "0.33.0"}') as (d, d_asked), \
            version_server(500) as (dead, dead_asked):
        pair = PDPair.__new__(PDPair)  # a started pair's state, no servers of ours
        pair.prefill, pair.decode, pair.deployment, pair.router = SimpleNamespace(url=p), SimpleNamespace(url=d), None, None
        pair.vllm_releases, pair.vllm_release = {"prefill": "0.32.0", "decode": "0.32.0"}, "0.32.0"
        pair._route_to_new_decode(warm_up=False)
        assert p_asked == [] and d_asked == ["/version"]
        assert (pair.vllm_releases, pair.vllm_release) == ({"prefill": "0.32.0", "decode": "0.33.0"}, "P 0.32.0 / D 0.33.0")
        pair.decode = SimpleNamespace(url=dead)
        pair._route_to_new_decode(warm_up=False)
        pair.router.close()
        assert dead_asked == ["/version"] and p_asked == []
        assert (pair.vllm_releases, pair.vllm_release) == ({"prefill": "0.32.0", "decode": "0.33.0"}, "P 0.32.0 / D 0.33.0")


def test_pair_label():
    assert pair_label("0.32.0", "0.32.0") == "0.32.0"
    assert pair_label("0.33.0", "0.32.0") == "P 0.33.0 / D 0.32.0"
    assert pair_label("unknown", "unknown") == "unknown"


def _pair(p_url: str, d_url: str, deployment=None) -> SimpleNamespace:
    return SimpleNamespace(prefill=SimpleNamespace(url=p_url), decode=SimpleNamespace(url=d_url), deployment=deployment)


def test_measure_pair_records_one_release_or_a_mixed_pair():
    with version_server(body=b'{"version": "0.33.0"}') as (p, _), version_server(body=b'{"version": "0.32.0+cpu"}') as (d, _):
        assert measure_pair(_pair(p, p)) == ({"prefill": "0.33.0", "decode": "0.33.0"}, "0.33.0")
        assert measure_pair(_pair(p, d)) == ({"prefill": "0.33.0", "decode": "0.32.0"}, "P 0.33.0 / D 0.32.0")
        assert measure_pair(_pair(p, d, pair_file()))[1] == "P 0.33.0 / D 0.32.0"  # nothing declared: recorded


def test_a_declared_release_refuses_a_server_that_reports_another():
    with version_server(body=b'{"version": "0.32.0+cpu"}') as (url, _):
        with pytest.raises(VllmReleaseMismatch) as info:
            measure_pair(_pair(url, url, pair_file(vllm_release="0.33.0")))
    text = str(info.value)
    assert isinstance(info.value, PairFileError) and info.value.vllm_release == "0.32.0"
    for side in ("P (prefill)", "D (decode)"):
        assert f"vllm_release: the pair file declares vLLM 0.33.0, but {side} reports vLLM 0.32.0 on GET /version" in text
    assert f"fix: point python in [hosts.local] (now {sys.executable}) at an interpreter that has vLLM 0.33.0" in text
    assert 'or set vllm_release = "0.32.0"' in text


def test_a_declared_release_that_matches_or_an_unknown_release_is_not_refused():
    with version_server(body=b'{"version": "0.33.0"}') as (good, _), version_server(500) as (dead, _):
        assert measure_pair(_pair(good, good, pair_file(vllm_release="0.33.0")))[1] == "0.33.0"
        assert measure_pair(_pair(good, dead, pair_file(vllm_release="0.33.0")))[1] == "P 0.33.0 / D unknown"


# -- report.json, JUnit, the table -------------------------------------------------------------------------
def _case_properties(junit_path) -> dict[tuple[str, str], dict[str, str]]:
    root = ET.parse(junit_path).getroot()
    return {(c.get("classname"), c.get("name")): {p.get("name"): p.get("value") for p in c.iter("property")}
            for c in root.iter("testcase")}


def test_report_json_junit_and_table_carry_the_release(tmp_path):
    hb = find_scenario("hb-loss-budget")
    suite = Suite([(hb, "stock")], tmp_path, pair_file="pairs/cpu-local.toml")
    suite.results.append(ScenarioResult("kill-decode", "leasekit", "PASS", "PASS", "ok", incident="K01",
                                        vllm_release="0.32.0", pair_file="pairs/cpu-local.toml"))
    pairless = suite.run_one(hb, "stock")  # no fault point in a stock connector: no pair, UNKNOWN
    assert pairless.vllm_release == "unknown" and pairless.pair_file == "pairs/cpu-local.toml"
    suite._fill_releases()  # what finish() does before the reports
    assert pairless.vllm_release == "0.32.0"
    suite.status = "completed"
    report = suite.report()
    suite._write(report)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["matrix"]["kill-decode"]["leasekit"] == {"verdict": "PASS", "expected": "PASS", "mode": "pull",
                                                         "vllm_release": "0.32.0"}
    assert [r["vllm_release"] for r in data["results"]] == ["0.32.0", "0.32.0"]
    assert data["vllm_releases"] == ["0.32.0"] and data["pair_file"] == "pairs/cpu-local.toml"
    assert [(r["scenario"], r["vllm_release"], sorted(r["targets"])) for r in data["matrix_rows"]] == [
        ("kill-decode", "0.32.0", ["leasekit"]), ("hb-loss-budget", "0.32.0", ["stock"])]
    props = _case_properties(tmp_path / "junit.xml")
    assert props[("leasekit", "kill-decode")] == {"transfer_mode": "pull", "vllm_release": "0.32.0",
                                                  "pair_file": "pairs/cpu-local.toml"}
    console = Console(record=True, width=200)
    console.print(matrix_table(suite.results))
    lines = console.export_text().splitlines()
    header = next(line for line in lines if "scenario" in line and "incident" in line)
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == ["scenario", "mode", "vLLM", "incident", "leasekit", "stock"]
    row = next(line for line in lines if "kill-decode" in line)
    assert [c.strip() for c in row.strip("│ ").split("│")] == ["kill-decode", "pull", "0.32.0", "K01", "PASS", "-"]


def test_a_pairless_cell_keeps_unknown_when_the_pairs_disagree(tmp_path):
    hb = find_scenario("hb-loss-budget")
    suite = Suite([(hb, "stock")], tmp_path)
    suite.results += [ScenarioResult("a", "leasekit", "PASS", "PASS", "", vllm_release=v) for v in ("0.32.0", "0.33.0")]
    pairless = suite.run_one(hb, "stock")
    suite._fill_releases()
    assert pairless.vllm_release == "unknown"


class NoPairPool:
    """A pool whose pair start fails (Suite.run_one's harness-error path); starts nothing."""

    started: list = []
    current = None

    def get(self, spec):
        raise RuntimeError("P did not become healthy")

    def close(self):
        pass


def test_a_failed_pair_start_takes_the_suite_release_so_its_row_does_not_split(tmp_path):
    kill = find_scenario("kill-decode")
    suite = Suite([(kill, "stock")], tmp_path, pool=NoPairPool())
    suite.results.append(ScenarioResult("kill-decode", "leasekit", "PASS", "PASS", "", incident="K01", vllm_release="0.32.0"))
    failed = suite.run_one(kill, "stock")
    assert failed.summary.startswith("harness error: RuntimeError") and failed.vllm_release == "unknown"
    suite._fill_releases()
    assert failed.vllm_release == "0.32.0"
    assert [(r["scenario"], r["vllm_release"], sorted(r["targets"])) for r in matrix_rows(suite.results)] == [
        ("kill-decode", "0.32.0", ["leasekit", "stock"])]
    suite.results.append(ScenarioResult("b", "leasekit", "PASS", "PASS", "", vllm_release="0.33.0"))
    failed.vllm_release = "unknown"
    suite._fill_releases()  # two releases measured: which one the failed pair had is not known
    assert failed.vllm_release == "unknown"


def test_a_result_takes_the_release_its_pair_reports_when_the_scenario_ends(tmp_path, monkeypatch):
    pair = SimpleNamespace(vllm_release="0.32.0")

    class OnePairPool(NoPairPool):
        def get(self, spec):
            return pair

        def release(self, reusable):
            pass

    class RestartsD:
        """Stands in for ScenarioExecution: its scenario restarts D, and the new D reports another release."""

        def __init__(self, scenario, target, pair, out, **_):
            self.pair, self.result = pair, ScenarioResult(scenario.name, target, "PASS", "PASS", "ok")

        def execute(self):
            assert self.result.vllm_release == "0.32.0"  # the release when the scenario started
            self.pair.vllm_release = "P 0.32.0 / D 0.33.0"
            return self.result

    monkeypatch.setattr("leasekit.chaos.suite.ScenarioExecution", RestartsD)
    kill = find_scenario("kill-decode")
    result = Suite([(kill, "leasekit")], tmp_path, pool=OnePairPool()).run_one(kill, "leasekit")
    assert result.verdict == "PASS" and result.vllm_release == "P 0.32.0 / D 0.33.0"


def test_the_table_splits_rows_by_release_and_shows_the_pair_file_when_several_ran():
    results = [ScenarioResult("kill-decode", t, "PASS", "PASS", "", incident="K01", vllm_release=v, pair_file=f)
               for f, v in (("pairs/a.toml", "0.32.0"), ("pairs/b.toml", "0.33.0")) for t in ("leasekit", "stock")]
    rows = matrix_rows(results)
    assert [(r["pair_file"], r["vllm_release"], sorted(r["targets"])) for r in rows] == [
        ("pairs/a.toml", "0.32.0", ["leasekit", "stock"]), ("pairs/b.toml", "0.33.0", ["leasekit", "stock"])]
    console = Console(record=True, width=200)
    console.print(matrix_table(results))
    text = console.export_text()
    assert "pair file" in text
    cells = [[c.strip() for c in line.strip("│ ").split("│")] for line in text.splitlines() if "kill-decode" in line]
    assert cells == [["kill-decode", "pull", "0.32.0", "pairs/a.toml", "K01", "PASS", "PASS"],
                     ["kill-decode", "pull", "0.33.0", "pairs/b.toml", "K01", "PASS", "PASS"]]


# -- several pair files --------------------------------------------------------------------------------------
RELEASES = {"pairs/a.toml": "0.32.0", "pairs/b.toml": "0.33.0"}


class StandInSuite(Suite):
    """A Suite whose runs end at once with one PASS on the release its pair file stands for (no pair is
    started); its reports are the real ones. ``interrupt_on``: the pair file whose run a SIGINT ends."""

    interrupt_on: str | None = None

    def execute(self, *, show: bool = True) -> dict:
        for scenario, target in self.runs:
            self.results.append(ScenarioResult(scenario.name, target, "PASS", "PASS", "ok", incident=scenario.incident,
                                               vllm_release=RELEASES.get(self.pair_file, "0.32.0"), pair_file=self.pair_file))
        if self.pair_file == self.interrupt_on:
            self.status, self.interrupt_signal, self.error = "interrupted", "SIGINT", "interrupted (SIGINT)"
        else:
            self.status = "completed"
        report = self.report()
        self._write(report)
        return report


def _entries():
    kill = find_scenario("kill-decode")
    return [(path, pair_file(), [(kill, "leasekit")]) for path in RELEASES]


def test_each_pair_file_runs_in_its_own_directory_and_the_matrix_holds_every_row(tmp_path):
    report = PairFileRuns(_entries(), tmp_path, suite_factory=StandInSuite).execute(show=False)
    assert report["status"] == "completed" and report["verdict"] == "PASS" and report["harness_errors"] == []
    subdirs = [tmp_path / "01-a", tmp_path / "02-b"]
    assert [f["run_dir"] for f in report["pair_files"]] == [str(d) for d in subdirs]
    for sub, release in zip(subdirs, RELEASES.values()):
        assert json.loads((sub / "report.json").read_text())["matrix"]["kill-decode"]["leasekit"]["vllm_release"] == release
    combined = json.loads((tmp_path / "report.json").read_text())
    assert "matrix" not in combined and combined["vllm_releases"] == ["0.32.0", "0.33.0"]
    assert [(r["pair_file"], r["scenario"], r["mode"], r["vllm_release"], r["targets"]["leasekit"]["verdict"])
            for r in combined["matrix_rows"]] == [("pairs/a.toml", "kill-decode", "pull", "0.32.0", "PASS"),
                                                  ("pairs/b.toml", "kill-decode", "pull", "0.33.0", "PASS")]
    props = _case_properties(tmp_path / "junit.xml")
    assert sorted(props) == [("leasekit", "kill-decode [01-a, vLLM 0.32.0]"), ("leasekit", "kill-decode [02-b, vLLM 0.33.0]")]
    assert props[("leasekit", "kill-decode [02-b, vLLM 0.33.0]")]["vllm_release"] == "0.33.0"


def test_two_pair_files_with_one_name_get_distinct_junit_names_and_matrix_labels(tmp_path, capsys):
    kill = find_scenario("kill-decode")
    entries = [(path, pair_file(), [(kill, "leasekit")]) for path in ("x/pair.toml", "y/pair.toml")]
    PairFileRuns(entries, tmp_path, suite_factory=StandInSuite).execute(show=True)
    assert sorted(_case_properties(tmp_path / "junit.xml")) == [
        ("leasekit", "kill-decode [01-pair, vLLM 0.32.0]"), ("leasekit", "kill-decode [02-pair, vLLM 0.32.0]")]
    rows = [[c.strip() for c in line.strip("│ ").split("│")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("│ kill-decode")]
    assert [row[:4] for row in rows] == [["kill-decode", "pull", "0.32.0", "01-pair"], ["kill-decode", "pull", "0.32.0", "02-pair"]]


def test_an_interrupt_skips_the_later_pair_files_and_still_writes_the_reports(tmp_path):
    class Interrupted(StandInSuite):
        interrupt_on = "pairs/a.toml"

    runs = PairFileRuns(_entries(), tmp_path, suite_factory=Interrupted)
    report = runs.execute(show=False)
    assert report["status"] == "interrupted" and report["verdict"] == "UNKNOWN" and runs.interrupt_signal == "SIGINT"
    assert [f["status"] for f in report["pair_files"]] == ["interrupted", "not run"]
    assert json.loads((tmp_path / "report.json").read_text())["status"] == "interrupted"
    assert not (tmp_path / "02-b").exists()


def test_pair_run_dir_names():
    assert pair_run_dir("/r", 3, "../x/my pair.toml").name == "03-my_pair"


def test_pair_is_repeatable_on_the_command_line(tmp_path, capsys):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text('lease_duration_s = 9\nvllm_release = "0.32.0"\n[prefill]\n[decode]\n')
    b.write_text('vllm_release = "0.33.0"\n[prefill]\n[decode]\n')
    args = build_parser().parse_args(["chaos", "run", "--all", "--pair", str(a), "--pair", str(b)])
    assert args.pair == [str(a), str(b)]
    loaded = _load_pairs(args)
    assert [(path, dep.vllm_release, duration) for path, dep, duration in loaded] == [
        (str(a), "0.32.0", 9), (str(b), "0.33.0", None)]
    args = build_parser().parse_args(["chaos", "run", "--all", "--pair", str(a), "--pair", str(b), "--lease-duration", "6"])
    assert [duration for _, _, duration in _load_pairs(args)] == [6, 6]
    assert _load_pairs(build_parser().parse_args(["chaos", "run", "--all"])) == [(None, None, None)]
    assert main(["chaos", "run", "--all", "--pair", str(a), "--pair", str(tmp_path / "." / "a.toml")]) == 2
    assert "given twice" in capsys.readouterr().err
    assert main(["chaos", "run", "kill-decode", "--pair", str(a), "--pair", str(b), "--plan"]) == 2
    assert "--plan takes one --pair" in capsys.readouterr().err
