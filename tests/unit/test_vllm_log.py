"""Stock vLLM P log -> lease timelines, on lines vLLM itself formats with our logging config.

The log lines are produced, not written by hand: a subprocess loads our JSON config through vLLM's
own loader (``vllm.logger._configure_vllm_root_logger`` with ``VLLM_LOGGING_CONFIG_PATH``) and
emits ``logging.LogRecord``s whose format strings are read out of the installed vLLM's source (so a
vLLM that rewords a lease line fails here), with chosen times and pids (several processes).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leasekit.chaos import FAIL, PASS
from leasekit.chaos.checks import check_bounded_reclaim, check_steady_state
from leasekit.lease import LeaseTiming
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.vllm_log import EVENT_LATE_READ, EVENT_RELEASE_INFERRED, OUTCOME_OPEN, parse_stock_lease_log
from leasekit.telemetry.vllm_logconfig import (
    DEFAULT_DEBUG_LOGGERS,
    GRANT_LOGGER,
    PULL_WORKER_LOGGER,
    PUSH_GRANT_LOGGER,
    RELEASE_LOGGER,
    WORKER_LOGGER,
    write_logging_config,
)

_SPEC = importlib.util.find_spec("vllm")
pytestmark = pytest.mark.skipif(_SPEC is None or _SPEC.origin is None, reason="vllm is not installed")
VLLM_DIR = Path(_SPEC.origin).parent if _SPEC and _SPEC.origin else Path("/nonexistent")
NIXL = "distributed/kv_transfer/kv_connector/v1/nixl"

T6 = LeaseTiming.from_lease_duration(6)  # H=1, E=4
T0 = 1_790_000_000.0  # epoch seconds of the first grant

# (vllm file, logger, a substring of the format string)
GRANT = (f"{NIXL}/pull_scheduler.py", GRANT_LOGGER, "waiting for %d seconds")
FINISHED_DBG = (f"{NIXL}/pull_scheduler.py", GRANT_LOGGER, "request_status=%s")
PUSH_GRANT = (f"{NIXL}/push_scheduler.py", PUSH_GRANT_LOGGER, "waiting for %d seconds")
PUSH_FINISHED_DBG = (f"{NIXL}/push_scheduler.py", PUSH_GRANT_LOGGER, "request_status=%s")
HEARTBEAT = (f"{NIXL}/base_worker.py", WORKER_LOGGER, "Heartbeat extended lease")
EXPIRE = (f"{NIXL}/base_worker.py", WORKER_LOGGER, "Releasing expired KV blocks")
LATE = (f"{NIXL}/pull_worker.py", PULL_WORKER_LOGGER, "Potentially invalid KV blocks")
FREED = ("v1/core/sched/scheduler.py", RELEASE_LOGGER, "Finished sending KV transfer")
WORKER_INIT = (f"{NIXL}/base_worker.py", WORKER_LOGGER, "Initializing NIXL worker %s")
SCHED_INIT = (f"{NIXL}/base_scheduler.py", "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler",
              "Initializing NIXL Scheduler %s")
GET_FINISHED = (f"{NIXL}/base_worker.py", WORKER_LOGGER, "get_finished: %s requests done sending")


def vllm_call(where: tuple[str, str, str]) -> dict:
    """The logger call in the installed vLLM whose format string contains the marker."""
    rel, logger, marker = where
    path = VLLM_DIR / rel
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "logger"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
            and marker in node.args[0].value
        ):
            found.append(node)
    assert len(found) == 1, f"{marker!r} in {rel}: {len(found)} logger calls"
    node = found[0]
    level = {"debug": "DEBUG", "info": "INFO", "warning": "WARNING", "error": "ERROR"}[node.func.attr]
    return {"logger": logger, "level": level, "fmt": node.args[0].value, "path": str(path), "lineno": node.lineno}


def rec(where, args, t, pid, proc) -> dict:
    return {**vllm_call(where), "args": list(args), "t": T0 + t, "pid": pid, "proc": proc}


def other(logger, level, msg, t, pid, proc) -> dict:
    return {"logger": logger, "level": level, "fmt": msg, "path": str(VLLM_DIR / "x.py"), "lineno": 1,
            "args": [], "t": T0 + t, "pid": pid, "proc": proc}


EMITTER = r"""
import json, logging, sys
from vllm.logger import _configure_vllm_root_logger, init_logger
_configure_vllm_root_logger()  # reads VLLM_LOGGING_CONFIG_PATH, as every vLLM process does
levels = {name: logging.getLogger(name).getEffectiveLevel() for name in json.loads(sys.argv[2])}
sys.stderr.write(json.dumps(levels))
for name, records in json.load(open(sys.argv[1])).items():
    sys.stdout.write("=== " + name + "\n"); sys.stdout.flush()
    for spec in records:
        logger = init_logger(spec["logger"])
        level = logging.getLevelName(spec["level"])
        if not logger.isEnabledFor(level):  # what logger.debug() & co. check first
            continue
        r = logger.makeRecord(logger.name, level, spec["path"], spec["lineno"], spec["fmt"], tuple(spec["args"]), None)
        r.created = spec["t"]
        r.msecs = int((spec["t"] - int(spec["t"])) * 1000)
        r.process = spec["pid"]
        r.vllm_process_name = spec["proc"]
        logger.handle(r)
"""


def emit(tmp: Path, scenarios: dict[str, list[dict]], probe: list[str]) -> tuple[dict[str, str], dict]:
    config = write_logging_config(tmp / "logging.json")
    spec = tmp / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    env = {**os.environ, "VLLM_LOGGING_CONFIG_PATH": str(config), "VLLM_CONFIGURE_LOGGING": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", EMITTER, str(spec), json.dumps(probe)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, str] = {}
    name = None
    for line in proc.stdout.splitlines(keepends=True):
        if line.startswith("=== "):
            name = line[4:].strip()
            out[name] = ""
        elif name is not None:
            out[name] += line
    levels = json.loads(proc.stderr.strip().splitlines()[-1]) if proc.stderr.strip() else {}
    return out, levels


E, W, W0, W1, API = (100, "EngineCore"), (200, "Worker"), (201, "Worker_TP0"), (202, "Worker_TP1"), (50, "APIServer")


def main_scenario() -> list[dict]:
    """TP=1, EngineCore + Worker + API server. A released, B expired then read late, C open, D quiet."""
    r = [
        rec(SCHED_INIT, ["eng-P"], -5.0, *E),
        rec(WORKER_INIT, ["eng-P"], -5.0, *W),
        other("vllm.entrypoints.openai.api_server", "INFO", "Route: /v1/completions", -4.0, *API),
        other("vllm.v1.engine.core", "DEBUG", "must be filtered out (not a lease logger)", -3.0, *E),
        other("vllm.v1.engine.core", "INFO", "a multi-line\nmessage: Heartbeat\nacross lines", -2.0, *E),
    ]
    for i, rid in enumerate(["A", "B", "C", "D"]):
        r.append(rec(FINISHED_DBG, [rid, "FINISHED_LENGTH_CAPPED", {"do_remote_decode": True}], 0.1 * i, *E))
        r.append(rec(GRANT, [rid, 6], 0.1 * i + 0.0005, *E))
    # Worker lines are emitted late (another process's buffer): the parser must order by time.
    for t in (1.0, 2.0):
        for rid in ["A", "B", "C"]:
            r.append(rec(HEARTBEAT, [rid, 4, 123.4, 127.4], t + 0.01, *W))
    r.append(rec(GET_FINISHED, [0, 1, 0, 0], 2.4999, *W))
    r.append(rec(FREED, ["A"], 2.5, *E))
    r.append(rec(EXPIRE, ["B", 0], 6.102, *W))  # bound: max(0.1 + 6, 2.01 + 4) = 6.1
    r.append(rec(FREED, ["B"], 6.103, *E))
    r.append(rec(LATE, ["B"], 8.0, *W))
    r.append(rec(LATE, ["B"], 8.001, *W))
    r.append(rec(HEARTBEAT, ["Z", 4, 1.0, 5.0], 3.0, *W))  # never granted: orphan
    r.append(other("vllm.v1.engine.core", "INFO", "last record", 9.0, *E))
    return r


def tp2_scenario() -> list[dict]:
    r = [rec(SCHED_INIT, ["eng-TP"], -5.0, *E), rec(WORKER_INIT, ["eng-TP"], -5.0, *W0), rec(WORKER_INIT, ["eng-TP"], -5.0, *W1)]
    rid = "cmpl-(weird) id-0"
    r.append(rec(GRANT, [rid, 6], 0.0, *E))
    r.append(rec(HEARTBEAT, [rid, 4, 6.0, 5.0], 1.0, *W0))
    r.append(rec(HEARTBEAT, [rid, 4, 6.0, 5.0], 1.002, *W1))
    r.append(rec(EXPIRE, [rid, 0], 6.004, *W1))
    r.append(rec(EXPIRE, [rid, 0], 6.003, *W0))
    r.append(rec(FREED, [rid], 6.01, *E))
    r.append(rec(GRANT, ["quiet", 6], 0.5, *E))  # no worker line at all: one timeline per worker
    r.append(rec(FREED, ["quiet"], 0.9, *E))
    return r


def mismatch_scenario() -> list[dict]:
    return [rec(GRANT, ["M", 30], 0.0, *E), rec(HEARTBEAT, ["M", 20, 30.0, 21.0], 1.0, *W), rec(FREED, ["M"], 2.0, *E)]


def push_scenario() -> list[dict]:
    """Push mode (vLLM's NixlPushConnector): P1 granted, heartbeated, freed when its WRITE is done."""
    return [rec(PUSH_FINISHED_DBG, ["P1", "FINISHED_LENGTH_CAPPED", {"do_remote_decode": True}], 0.0, *E),
            rec(PUSH_GRANT, ["P1", 6], 0.0005, *E), rec(HEARTBEAT, ["P1", 4, 6.0, 5.0], 1.0, *W),
            rec(FREED, ["P1"], 1.5, *E)]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    scenarios = {"main": main_scenario(), "tp2": tp2_scenario(), "mismatch": mismatch_scenario(), "push": push_scenario()}
    probe = [*DEFAULT_DEBUG_LOGGERS, "vllm", "vllm.v1.engine.core", "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler"]
    text, levels = emit(tmp_path_factory.mktemp("vllm_log"), scenarios, probe)
    return text, levels


def by_id(leases):
    out = {}
    for lease in leases:
        out.setdefault(lease.request_id, []).append(lease)
    return out


def test_config_is_vllms_default_with_ms_epoch_pid_and_name(tmp_path):
    path = write_logging_config(tmp_path / "sub" / "logging.json")
    config = json.loads(path.read_text())
    fmt = config["formatters"]["vllm"]
    assert fmt["()"] == "vllm.logging_utils.NewLineFormatter"
    for part in ("%(created).6f", "%(msecs)03d", "%(process)d", "%(name)s", "%(vllm_process_name)s", "%(levelname)s"):
        assert part in fmt["format"]
    assert config["handlers"]["vllm"]["level"] == "DEBUG"
    assert config["loggers"]["vllm"] == {"handlers": ["vllm"], "level": "INFO", "propagate": False}
    debug = {name for name, c in config["loggers"].items() if c.get("level") == "DEBUG"}
    assert debug == set(DEFAULT_DEBUG_LOGGERS)
    assert config["disable_existing_loggers"] is False


def test_logger_names_are_the_vllm_module_names():
    for name in DEFAULT_DEBUG_LOGGERS:
        source = VLLM_DIR.parent / (name.replace(".", "/") + ".py")
        assert "logger = init_logger(__name__)" in source.read_text(), name


def test_vllm_loads_the_config_and_debug_reaches_only_lease_loggers(logs):
    text, levels = logs
    for name in DEFAULT_DEBUG_LOGGERS:
        assert levels[name] == 10, name
    assert levels["vllm"] == levels["vllm.v1.engine.core"] == 20
    assert levels["vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler"] == 20
    main = text["main"]
    assert "must be filtered out" not in main
    assert "Heartbeat extended lease for request A by 4s (old_expiry=123.4, new_expiry=127.4)" in main
    assert f"t={T0 + 2.5:.6f} {RELEASE_LOGGER} [scheduler.py:" in main
    assert "(Worker pid=200) DEBUG " in main
    # NewLineFormatter repeats the prefix on continuation lines
    assert main.count("(EngineCore pid=100) INFO ") >= 4


def test_released_expired_open_and_late_reads(logs):
    text, _ = logs
    garbage = [
        "2026-11-30 14:31:44 NIXL INFO    _api.py:405 Backend UCX was instantiated",
        "Traceback (most recent call last):",
        "",
        "\x00\xff\ufffd binary junk",
        "INFO:     127.0.0.1:5555 - \"POST /v1/completions HTTP/1.1\" 200 OK",
    ]
    lines = text["main"].splitlines()
    hb = next(line for line in lines if "Heartbeat extended lease for request C" in line)
    bad = [
        hb[: hb.index("Heartbeat") - 5],  # cut short after the logger name
        hb[: hb.index("new_expiry")],  # cut short in the message
        hb.replace("old_expiry=123.4", "old_expiry=abc"),
        hb.replace(f"t={T0 + 1.01:.6f}", "t=nan"),
        hb.replace(" pid=200)", " pid=)"),
    ]
    mixed = lines[:7] + garbage + lines[7:] + bad
    result = parse_stock_lease_log(mixed, lease_duration_s=6, extension_s=4)

    assert result.bad_lines == len(bad)
    assert result.other_lines == len(garbage)
    assert result.orphan_events == 1  # Z
    leases = by_id(result.leases)
    opened = by_id(result.open_leases)
    assert set(leases) == {"A", "B"} and set(opened) == {"C", "D"}

    (a,) = leases["A"]
    assert a.outcome == sc.OUTCOME_RELEASED
    assert a.grant_s == pytest.approx(T0 + 0.0005, abs=1e-6)
    assert a.heartbeats_s == pytest.approx((T0 + 1.01, T0 + 2.01), abs=1e-6)
    assert a.end_s == pytest.approx(T0 + 2.5, abs=1e-6)
    assert a.engine_id == "eng-P" and a.tp_rank == 0 and a.lease_duration_s == 6 and a.extension_s == 4
    assert [name for name, _ in a.events] == ["grant", "extend", "extend", "release"]

    (b,) = leases["B"]
    assert b.outcome == sc.OUTCOME_EXPIRED
    assert b.end_s == pytest.approx(T0 + 6.102, abs=1e-6)
    assert b.deadline_s == pytest.approx(max(T0 + 0.1005 + 6, T0 + 2.01 + 4), abs=1e-6)
    assert [name for name, _ in b.events][-2:] == [EVENT_LATE_READ, EVENT_LATE_READ]
    assert result.late_reads == [("B", pytest.approx(T0 + 8.0, abs=1e-6)), ("B", pytest.approx(T0 + 8.001, abs=1e-6))]
    assert result.first_late_reads() == {"B": pytest.approx(T0 + 8.0, abs=1e-6)}

    (c,) = opened["C"]
    assert c.outcome == OUTCOME_OPEN and c.heartbeat_count == 2
    assert c.end_s == pytest.approx(T0 + 9.0, abs=1e-6)  # the last instant the log covers
    (d,) = opened["D"]
    assert d.heartbeat_count == 0 and d.engine_id == "eng-P"

    # The same evidence holds the checks the span path is held to.
    reclaim = check_bounded_reclaim(result.leases, ["B"], T6, tick_s=0.5, fault_at_s=T0 + 3.0)
    assert reclaim.verdict == PASS, reclaim.rows[0].reason
    steady = check_steady_state(result.leases, ["A"], {}, T6, all_served=False)
    assert steady.verdict == PASS
    pinned = check_bounded_reclaim(result.leases, ["C"], T6, tick_s=0.5)
    assert pinned.verdict == FAIL and "still pinned" in pinned.rows[0].reason


def test_served_rule_and_text_input(logs):
    text, _ = logs
    served = {"C": T0 + 20, "D": T0 + 20, "A": T0 + 20}  # a mapping works (its keys)
    result = parse_stock_lease_log(text["main"], lease_duration_s=6, extension_s=4, served=served)
    leases = by_id(result.leases)
    assert result.open_leases == []
    (a,) = leases["A"]
    assert a.end_s == pytest.approx(T0 + 2.5, abs=1e-6)  # a logged release wins over the rule
    (c,) = leases["C"]
    assert c.outcome == sc.OUTCOME_RELEASED and c.end_s == pytest.approx(T0 + 2.01, abs=1e-6)
    assert c.events[-1][0] == EVENT_RELEASE_INFERRED
    (d,) = leases["D"]
    assert d.end_s == d.grant_s
    assert parse_stock_lease_log(text["main"].encode(), lease_duration_s=6, extension_s=4).records == result.records


def test_tp2_one_timeline_per_worker_and_odd_ids(logs):
    text, _ = logs
    result = parse_stock_lease_log(text["tp2"].splitlines(keepends=True), lease_duration_s=6, extension_s=4)
    leases = by_id(result.leases)
    weird = sorted(leases["cmpl-(weird) id-0"], key=lambda t: t.tp_rank)
    assert [(t.tp_rank, t.outcome) for t in weird] == [(0, "expired"), (1, "expired")]
    assert weird[0].end_s == pytest.approx(T0 + 6.003, abs=1e-6)
    assert weird[1].heartbeats_s == pytest.approx((T0 + 1.002,), abs=1e-6)
    assert {t.engine_id for t in weird} == {"eng-TP"}
    quiet = sorted(leases["quiet"], key=lambda t: t.tp_rank)
    assert [(t.tp_rank, t.outcome) for t in quiet] == [(0, "released"), (1, "released")]


def test_logged_lease_duration_wins_when_it_disagrees(logs):
    text, _ = logs
    (m,) = parse_stock_lease_log(text["mismatch"], lease_duration_s=6, extension_s=4).leases
    assert (m.lease_duration_s, m.extension_s) == (30.0, 20.0)
    row = check_bounded_reclaim([m], ["M"], T6, tick_s=0.5).rows[0]
    assert "P ran with L=30.0 s" in row.reason
    # A float L is logged with %d: int(6.5) == 6 keeps the caller's exact value.
    (m,) = parse_stock_lease_log(text["mismatch"], lease_duration_s=30.5, extension_s=20.0).leases
    assert m.lease_duration_s == 30.5


def test_regrant_and_empty_input():
    assert parse_stock_lease_log([], lease_duration_s=6, extension_s=4).leases == []
    assert parse_stock_lease_log("garbage\n\n", lease_duration_s=6, extension_s=4).other_lines == 2
    head = "(EngineCore pid=1) DEBUG 01-01 00:00:00.000 t={t:.6f} x [pull_scheduler.py:258] "
    grant = head + "NIXLConnector request_finished(R) waiting for 6 seconds before releasing blocks"
    result = parse_stock_lease_log([grant.format(t=10.0), grant.format(t=11.0)], lease_duration_s=6, extension_s=4)
    assert result.regrants == 1
    assert [t.grant_s for t in result.open_leases] == [10.0, 11.0]



def test_push_mode_grant_line_is_a_grant(logs):
    # vLLM's NixlPushConnector logs the grant from push_scheduler.py (at DEBUG, which the config turns on)
    text, levels = logs
    assert levels[PUSH_GRANT_LOGGER] == 10  # DEBUG
    result = parse_stock_lease_log(text["push"], lease_duration_s=6, extension_s=4)
    (lease,) = result.leases
    assert (lease.request_id, lease.grant_s, lease.heartbeat_count) == ("P1", T0 + 0.0005, 1)
    assert lease.end_s == T0 + 1.5 and result.bad_lines == 0
