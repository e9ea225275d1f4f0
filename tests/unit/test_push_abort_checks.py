"""The push-mode abort checks of the chaos harness: ``no_late_write`` (D counted no WRITE notification for a request it
no longer waited on, from vLLM's ``vllm:nixl_num_notifications_after_expiry``) and the evidence that an abort storm under
a stalled push writer aborted its requests after D registered them and before their WRITE landed
(leasekit/chaos/pusheffects.py); the scenario rule that places the cancels there."""

from __future__ import annotations

import typing
from types import SimpleNamespace

import httpx
import pytest

from leasekit.chaos import FAIL, PASS, UNKNOWN
from leasekit.chaos.endchecks import LATE_WRITE_METRIC, check_no_late_write, late_writes, late_writes_on
from leasekit.chaos.evidence import ClockMismatch
from leasekit.chaos.pusheffects import aborted_mid_push
from leasekit.chaos.scenario import ScenarioError, catalog_dir, find_scenario, load_scenario
from leasekit.chaos.schema import CHECKS, CheckName
from leasekit.cluster.router import DecodeResult
from leasekit.telemetry.lease_timeline import LeaseTimeline


def test_no_late_write_fails_on_any_late_write_during_the_run_and_says_unknown_without_both_readings():
    assert check_no_late_write(2.0, 2.0).verdict == PASS
    failed = check_no_late_write(2.0, 3.0)
    assert failed.verdict == FAIL and failed.summary.startswith("1 WRITE(s) finished on D")
    assert check_no_late_write(None, 0.0).verdict == UNKNOWN and "before the fault run" in check_no_late_write(None, 0.0).summary
    assert check_no_late_write(0.0, None).verdict == UNKNOWN
    assert check_no_late_write(0.0, 5.0, decode_killed=True).verdict == UNKNOWN  # a new D's counter restarted


def test_the_late_write_count_is_read_from_the_counters_sample_and_unreadable_is_none():
    assert late_writes({LATE_WRITE_METRIC + "_total": 3.0, "vllm:other": 1.0}) == 3.0
    assert late_writes({LATE_WRITE_METRIC: 2.0}) == 2.0
    assert late_writes({"vllm:kv_cache_usage_perc": 0.0}) is None

    class Gone:
        def metrics(self):
            raise httpx.ConnectError("refused")

    assert late_writes_on(Gone()) is None
    assert late_writes_on(SimpleNamespace(metrics=lambda: {LATE_WRITE_METRIC + "_total": 1.0})) == 1.0


def test_the_check_names_of_the_schema_are_one_list():
    assert typing.get_args(CheckName) == CHECKS and "no_late_write" in CHECKS


def _lease(rid: str, outcome: str, end: float) -> LeaseTimeline:
    return LeaseTimeline(request_id=rid, engine_id="P", tp_rank=0, kv_blocks=1, lease_duration_s=6.0, extension_s=4.0,
                         grant_s=100.0, initial_deadline_s=106.0, heartbeats_s=(), heartbeat_count=0,
                         last_heartbeat_s=None, deadline_s=end, end_s=end, outcome=outcome, retrievals=0,
                         step_gap_s=None, remote_agent="D")


def _load(cancel_gave_up: dict[int, float]):
    intent = {0: "decode", 1: "decode", 2: "cancel", 3: "cancel"}
    decodes = {0: DecodeResult(200, 1.0, token_ids=[1]), 1: DecodeResult(200, 1.0, token_ids=[1])}
    for index, at in cancel_gave_up.items():
        decodes[index] = DecodeResult(0, 6.0, error="ReadTimeout", done_monotonic_s=at, done_wall_s=at)
    return SimpleNamespace(intent=intent, decodes=decodes, request_id=lambda i: f"r{i}")


SCENARIO = find_scenario("abort-registered-push")


def test_an_abort_counts_as_mid_push_only_if_its_write_finished_after_its_client_gave_up():
    same_clock = lambda monotonic_s, wall_s: monotonic_s  # noqa: E731 (P on this host)
    load = _load({2: 106.0, 3: 106.1})
    leases = [_lease("r2", "released", 109.8), _lease("r3", "released", 109.9), _lease("r0", "released", 110.5)]
    (effect,) = aborted_mid_push(SCENARIO, load, leases, same_clock)
    assert effect.took_effect and effect.evidence.startswith("2 of 2 cancelled requests")
    early = [_lease("r2", "released", 105.0), _lease("r3", "expired", 110.0)]  # written before the abort; never registered
    (effect,) = aborted_mid_push(SCENARIO, load, early, same_clock)
    assert not effect.took_effect
    assert "request 2: its WRITE finished 1.000 s before its client gave up" in effect.evidence
    assert "request 3: no WRITE released its lease (D never registered it)" in effect.evidence

    def no_clock(monotonic_s, wall_s):
        raise ClockMismatch("P runs under libfaketime")

    (effect,) = aborted_mid_push(SCENARIO, load, leases, no_clock)
    assert not effect.took_effect and "libfaketime" in effect.evidence


def test_the_mid_push_evidence_belongs_to_push_writer_stalls_with_cancels_only():
    load = _load({2: 106.0, 3: 106.1})
    assert aborted_mid_push(find_scenario("abort-storm-push"), load, [], lambda m, w: m) == []  # no writer stall
    load.intent = {0: "decode", 1: "decode"}
    assert aborted_mid_push(SCENARIO, load, [], lambda m, w: m) == []
    assert aborted_mid_push(SCENARIO, None, [], lambda m, w: m) == []


def test_the_cancels_of_an_abort_storm_under_a_writer_stall_must_fall_between_registration_and_write(tmp_path):
    original = (catalog_dir() / "abort-registered-push.toml").read_text()  # the shipped scenario, edited
    assert load_scenario_text(tmp_path, original).cancel_after_s() == 6.0  # 2H + 4 s at L = 6
    with pytest.raises(ScenarioError, match=r"later than hold_decode_slot_s \(3.5 s\) and earlier than that \+ "
                                            r"faults.0.duration_s \(9.5 s\), got 3 s"):
        load_scenario_text(tmp_path, original.replace('cancel_after_s = "2H + 4s"', 'cancel_after_s = 3'))
    with pytest.raises(ScenarioError, match=r"got 10 s"):
        load_scenario_text(tmp_path, original.replace('cancel_after_s = "2H + 4s"', 'cancel_after_s = 10'))


def load_scenario_text(tmp_path, text: str):
    path = tmp_path / "abort-registered-push.toml"
    path.write_text(text)
    return load_scenario(path)
