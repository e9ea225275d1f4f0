"""The pure statistics of benchmarks/telemetry_overhead.py (package benchmarks/overhead): percentiles,
spreads, ratios, the goal verdict (met / not met / inconclusive) and the span-volume verdict. No vLLM,
no servers."""

import math
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # benchmarks/ is not installed: import it from the checkout, as the command does
    sys.path.insert(0, _ROOT)

from benchmarks.overhead.report import analyze, format_table
from benchmarks.overhead.spans import SpanPhase, span_volume_verdict
from benchmarks.overhead.stats import (
    RunStats,
    counter_deltas,
    overhead,
    percentile,
    ratios,
    relative_spread,
    target_summary,
)
from benchmarks.overhead.verdicts import (
    INCONCLUSIVE,
    MET,
    NOT_MET,
    Verdict,
    goal_verdict,
    metric_verdict,
)
from benchmarks.overhead.workload import round_order, seeded_prompts


def run(target, k, wall, latencies, requests=None, tokens_per_request=16):
    ok = len(latencies)
    return RunStats(target, k, requests or ok, ok, ok * tokens_per_request, wall, list(latencies))


# -- percentile / spread ----------------------------------------------------------------------
def test_percentile_interpolates_between_closest_ranks_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 99) == pytest.approx(3.97)  # numpy.percentile([1,2,3,4], 99)
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0


def test_percentile_refuses_empty_and_out_of_range():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_relative_spread_is_range_over_median():
    assert relative_spread([0.99, 1.0, 1.01]) == pytest.approx(0.02)
    assert relative_spread([10.0, 10.0]) == 0.0
    assert relative_spread([5.0]) is None  # one round: no spread estimate
    assert relative_spread([]) is None


# -- summaries and ratios ---------------------------------------------------------------------
def test_target_summary_pools_throughput_over_wall_time_and_latencies_over_requests():
    runs = [run("stock", 0, 10.0, [1.0] * 20), run("stock", 1, 5.0, [2.0] * 10, requests=12)]
    s = target_summary(runs)
    assert s["requests"] == 32 and s["ok"] == 30 and s["failed"] == 2
    assert s["rps"] == pytest.approx(30 / 15)  # not the mean of 2.0 and 2.0 per round
    assert s["tokens_per_s"] == pytest.approx(30 * 16 / 15)
    assert s["per_round"]["rps"] == [pytest.approx(2.0), pytest.approx(2.0)]
    assert s["p50_s"] == pytest.approx(1.0)
    assert s["p99_s"] == pytest.approx(2.0)
    assert s["spread"]["rps"] == pytest.approx(0.0)
    assert s["spread"]["p50_s"] == pytest.approx(1.0 / 1.5)


def test_target_summary_refuses_no_completed_request():
    with pytest.raises(ValueError):
        target_summary([RunStats("leasekit", 0, 5, 0, 0, 1.0, [])])


def test_ratios_are_leasekit_over_stock_with_per_round_min_max():
    stock = target_summary([run("stock", 0, 10.0, [1.0] * 10), run("stock", 1, 10.0, [1.0] * 10)])
    lk = target_summary([run("leasekit", 0, 10.0, [1.1] * 10), run("leasekit", 1, 12.5, [1.0] * 10)])
    r = ratios(lk, stock)
    assert r["rps"]["per_round"] == [pytest.approx(1.0), pytest.approx(0.8)]
    assert (r["rps"]["min"], r["rps"]["max"]) == (pytest.approx(0.8), pytest.approx(1.0))
    assert r["rps"]["ratio"] == pytest.approx(20 / 22.5 / (20 / 20))
    assert r["p50_s"]["per_round"] == [pytest.approx(1.1), pytest.approx(1.0)]
    assert r["rps"]["rounds_worse"] == 1  # round 1 slower; round 0 equal is not worse
    assert r["p50_s"]["rounds_worse"] == 1  # round 0 higher latency


def test_overhead_sign_follows_the_metric_direction():
    assert overhead(0.97, higher_is_better=True) == pytest.approx(0.03)  # 3 % less throughput
    assert overhead(1.05, higher_is_better=False) == pytest.approx(0.05)  # 5 % more latency
    assert overhead(1.05, higher_is_better=True) == pytest.approx(-0.05)  # faster than stock


# -- verdicts ---------------------------------------------------------------------------------
def ratio(pooled, per_round):
    return {"ratio": pooled, "per_round": per_round, "min": min(per_round), "max": max(per_round)}


def quiet(stock, leasekit=0.0):
    return {"stock": stock, "leasekit": leasekit}


def test_quiet_baseline_and_small_overhead_is_met():
    v = metric_verdict("rps", ratio(0.99, [0.985, 0.99, 0.995]), quiet(0.01), higher_is_better=True)
    assert v.status == MET and v.overhead == pytest.approx(0.01)


def test_quiet_baseline_and_large_overhead_is_not_met():
    v = metric_verdict("p99_s", ratio(1.05, [1.04, 1.05, 1.06]), quiet(0.01), higher_is_better=False)
    assert v.status == NOT_MET


def test_overhead_exactly_at_the_goal_is_met():
    v = metric_verdict("rps", ratio(0.98, [0.98, 0.98, 0.98]), quiet(0.0), higher_is_better=True)
    assert v.status == MET


def test_noisy_baseline_is_inconclusive_even_when_the_pooled_ratio_looks_fine():
    v = metric_verdict("rps", ratio(1.0, [0.95, 1.0, 1.05]), quiet(0.06), higher_is_better=True)
    assert v.status == INCONCLUSIVE
    assert "stock baseline itself varies 6.0%" in v.reason and "cannot be resolved" in v.reason


def test_noisy_baseline_with_a_moderate_miss_is_inconclusive_not_a_fake_fail():
    # 5 % pooled overhead, but the best round is within tolerance + noise
    v = metric_verdict("rps", ratio(0.95, [0.92, 0.95, 0.97]), quiet(0.05), higher_is_better=True)
    assert v.status == INCONCLUSIVE


def test_noisy_baseline_with_a_decisive_miss_is_not_met():
    # every round at least 20 % slower; the baseline moves only 5 %
    v = metric_verdict("p99_s", ratio(1.3, [1.2, 1.3, 1.4]), quiet(0.05), higher_is_better=False)
    assert v.status == NOT_MET


def test_quiet_stock_but_noisy_leasekit_is_inconclusive():
    # measured: stock p99 772.0 / 772.7 ms by chance while leasekit's moved 25 %; ratios straddle 1
    v = metric_verdict("p99_s", ratio(1.2, [0.935, 1.1, 1.21]), quiet(0.001, 0.25), higher_is_better=False)
    assert v.status == INCONCLUSIVE and "leasekit pair varies 25.0%" in v.reason


def test_two_rounds_are_too_few_for_a_verdict():
    # the measured false "not met": two rounds, a chance-quiet stock p99
    v = metric_verdict("p99_s", ratio(1.204, [0.935, 1.210]), quiet(0.001, 0.001), higher_is_better=False)
    assert v.status == INCONCLUSIVE and "fewer than 3 rounds" in v.reason


def test_single_round_is_inconclusive():
    v = metric_verdict("rps", ratio(1.0, [1.0]), quiet(None, None), higher_is_better=True)
    assert v.status == INCONCLUSIVE and "fewer than 3 rounds" in v.reason


def test_nan_ratio_is_inconclusive():
    v = metric_verdict("rps", {"ratio": math.nan, "per_round": [], "min": None, "max": None}, quiet(0.0),
                          higher_is_better=True)
    assert v.status == INCONCLUSIVE


def test_goal_combines_metrics_and_request_failures():
    met = Verdict("rps", MET, 0.0, "")
    unsure = Verdict("p99_s", INCONCLUSIVE, 0.0, "noisy")
    miss = Verdict("p99_s", NOT_MET, 0.1, "slow")
    assert goal_verdict([met, met], {}).status == MET
    assert goal_verdict([met, unsure], {}).status == INCONCLUSIVE
    assert goal_verdict([unsure, miss], {}).status == NOT_MET
    assert goal_verdict([met, met], {"leasekit": 1}).status == NOT_MET
    assert goal_verdict([met, met], {"stock": 2, "leasekit": 0}).status == INCONCLUSIVE


# -- span volume ------------------------------------------------------------------------------
def phase(name, requests, spans, extensions):
    return SpanPhase(name, requests, spans, list(extensions))


def test_span_volume_constant_while_extensions_grow_is_shown():
    v = span_volume_verdict([phase("rounds", 100, 100, [0] * 100), phase("queued 6H", 10, 10, [6] * 10)])
    assert v["status"] == "shown" and v["slope"] == pytest.approx(0.0)


def test_span_per_heartbeat_is_a_violation():
    # one child span per extension: 1 + 6 spans per request when leases see 6 extensions
    v = span_volume_verdict([phase("rounds", 100, 100, [0] * 100), phase("queued 6H", 10, 70, [6] * 10)])
    assert v["status"] == "violated" and v["slope"] == pytest.approx(1.0)


def test_span_volume_without_extension_growth_is_not_shown():
    v = span_volume_verdict([phase("rounds", 100, 100, [0] * 100), phase("queued 1H", 10, 10, [1] * 10)])
    assert v["status"] == "not shown" and "longer" in v["reason"]
    assert span_volume_verdict([phase("rounds", 10, 10, [0] * 10)])["status"] == "not shown"


def test_one_stray_span_in_a_queue_phase_stays_within_the_slope_limit():
    v = span_volume_verdict([phase("rounds", 256, 256, [0] * 256), phase("queued 6H", 10, 11, [6] * 10)])
    assert v["status"] == "shown"  # +0.1 span/request over 6 extensions: slope 0.017


# -- run order and prompts --------------------------------------------------------------------
def test_round_order_alternates_abba():
    assert round_order(3) == [(0, "stock"), (0, "leasekit"), (1, "leasekit"), (1, "stock"),
                                 (2, "stock"), (2, "leasekit")]


def test_prompts_are_shared_within_a_round_and_fresh_across_rounds():
    a = seeded_prompts(0, 1, 4, 48, 1024)
    assert a == seeded_prompts(0, 1, 4, 48, 1024)
    assert a != seeded_prompts(0, 2, 4, 48, 1024)
    assert all(len(p) == 48 and all(3 <= t < 1024 for t in p) for p in a)


def test_counter_deltas_take_counters_present_in_both_scrapes():
    before = {"P": {"leasekit_kv_lease_grants_total": 10.0, "leasekit_kv_leases_active": 2.0}}
    after = {"P": {"leasekit_kv_lease_grants_total": 25.0, "leasekit_kv_leases_active": 0.0,
                   "leasekit_kv_lease_new_total": 3.0}, "D": {"leasekit_x_total": 1.0}}
    assert counter_deltas(before, after) == {"P": {"leasekit_kv_lease_grants_total": 15.0}, "D": {}}


def test_analyze_and_table_end_to_end_on_synthetic_measurements():
    runs = {
        "stock": [run("stock", k, 10.0, [0.40] * 30 + [0.50] * 2) for k in range(4)],
        "leasekit": [run("leasekit", k, 10.5, [0.42] * 30 + [0.60] * 2) for k in range(4)],
    }
    rounds = [SpanPhase(f"round {k}", 32, 64, [0] * 32, {"kv_lease": 32, "kv_lease_heartbeats": 32},
                           {"released": 32}) for k in range(4)]
    queued = [SpanPhase("queued 6H", 10, 20, [6] * 10, {"kv_lease": 10, "kv_lease_heartbeats": 10})]
    doc = analyze(runs, rounds, queued)
    # a steady 5 % throughput loss on a perfectly quiet baseline: not met, and the p99 too
    assert doc["ratios"]["rps"]["ratio"] == pytest.approx(10 / 10.5)
    assert doc["verdicts"]["rps"]["status"] == NOT_MET
    assert doc["verdicts"]["p99_s"]["status"] == NOT_MET
    assert doc["goal_verdict"]["status"] == NOT_MET
    assert [p["name"] for p in doc["span_phases"]][-2:] == ["rounds", "queued 6H"]
    assert doc["span_phases"][-2]["spans_per_request"] == pytest.approx(2.0)
    assert doc["span_volume"]["status"] == "shown"
    doc.update(config={"rounds": 4, "requests": 32, "concurrency": 4, "prompt_tokens": 48, "max_tokens": 16,
                       "decode_max_seqs": 4},
               lease_timing={"L_s": 6, "H_s": 1, "E_s": 4}, result_file="x.json",
               leasekit_metrics={"delta": {"P": {"leasekit_kv_lease_extensions_total": 60.0}}})
    doc["span_volume"].update(stock_pair_spans=0, unparsable_span_lines=0)
    table = format_table(doc)
    assert "NOT MET" in table and "0.952" in table and "lease_extensions +60" in table
