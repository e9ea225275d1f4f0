"""The grant pledge (leasekit/lease/pledge.py): the clock bound is never below the true remote clock, the
gate uses a pledge only when the bound proves it held, and P holds a pledged lease's blocks past an early
completion (leasekit/vllm/prefill/pledges.py over the stand-in worker of test_p_notifications)."""

import math
import time

import pytest
from hypothesis import given, settings, strategies as st

from leasekit.lease.codec import Ack, decode_notification, encode_ack
from leasekit.lease.pledge import (RATE_ERROR, RATE_FACTOR, Pledge, RemoteClockBound, encode_pledge, parse_pledge,
                                   pledge_until)
from leasekit.lease.readgate import HOLD, PROOF_ACK, PROOF_PLEDGE, PROOF_VERDICT, ReadGate
from leasekit.lease.settings import ReadGateConfigError, lint_leasekit_keys, pledge_seconds
from leasekit.telemetry import semconv as sc
from leasekit.vllm.stats import PLEDGE_HOLDS

from tests.unit.test_p_notifications import L, Worker

rates = st.floats(1 - RATE_ERROR, 1 + RATE_ERROR)


def _clock(segments, offset):
    """A clock running at piecewise-constant rates: ``segments`` of (true seconds, rate); returns
    reading(tau)."""
    def reading(tau):
        value, t = offset, 0.0
        for length, rate in segments:
            step = min(length, max(0.0, tau - t))
            value += step * rate
            t += length
        return value + max(0.0, tau - t) * segments[-1][1]
    return reading


segments = st.lists(st.tuples(st.floats(0.01, 20), rates), min_size=1, max_size=6)


@settings(max_examples=400, deadline=None)
@given(offset=st.floats(-1e6, 1e6), d_segments=segments, p_segments=segments,
       sends=st.lists(st.tuples(st.floats(0, 50), st.floats(0, 3)), min_size=1, max_size=5), at=st.floats(0, 80))
def test_the_bound_is_never_below_the_remote_clock(offset, d_segments, p_segments, sends, at):
    """True time tau; D's and P's clocks run at rates within RATE_ERROR that change over time, P's from an
    arbitrary offset. D sends at true time ``send``, P reads its clock ``delay`` later. For any D instant
    (before or after the sends), the bound over all samples is at least P's true reading (to 1 us)."""
    d_clock, p_clock = _clock(d_segments, 1000.0), _clock(p_segments, offset)
    bound = RemoteClockBound()
    for send, delay in sends:
        assert not bound.add_sample("p", d_clock(send), p_clock(send + delay), d_clock(send + delay))
    assert bound.upper_bound("p", d_clock(at)) >= p_clock(at) - 1e-6


def test_a_sample_that_contradicts_the_kept_ones_replaces_them():
    bound = RemoteClockBound()
    bound.add_sample("p", 10.0, 100.0, 10.1)
    assert bound.add_sample("p", 20.0, 5000.0, 20.1)  # P's clock jumped (another clock under this id)
    assert bound.upper_bound("p", 20.0) == 5000.0


def test_the_bound_takes_the_tightest_sample_and_grows_at_the_rate_factor():
    bound = RemoteClockBound()
    assert bound.upper_bound("p", 1.0) is None
    bound.add_sample("p", 10.0, 110.0)  # a slow ack: P read 110 at some D time >= 10
    bound.add_sample("p", 20.0, 120.0)
    assert bound.upper_bound("p", 20.0) == pytest.approx(120.0)
    assert bound.upper_bound("p", 21.0) == pytest.approx(120.0 + RATE_FACTOR)
    assert bound.upper_bound("p", 15.0) == pytest.approx(110.0 + 5 * RATE_FACTOR)  # only the first applies
    assert bound.upper_bound("other", 21.0) is None
    assert bound.covers(Pledge(121.5, "c"), 21.0, ["p"]) and not bound.covers(Pledge(121.0, "c"), 21.0, ["p"])
    assert not bound.covers(None, 21.0, ["p"]) and not bound.covers(Pledge(1e9, "c"), 21.0, ["q"])
    assert not bound.covers(Pledge(1e9, "c"), 21.0, []) and not bound.covers(Pledge(121.5, "c"), 21.0, ["p", "q"])


@pytest.mark.parametrize("value", [None, [], [1], [1, "a", 3], ["1", "a"], [True, "a"], [math.inf, "a"], [1.5, "a"],
                                   [-1, "a"], [1 << 62, "a"], [1, ""], [1, "a:b"], [1, "a,b"], [1, "x" * 65], [1, 5]])
def test_a_malformed_pledge_is_ignored(value):
    assert parse_pledge(value) is None


def test_pledge_parsing_and_its_end_never_past_the_deadline():
    assert encode_pledge(12.5000019, "27c774c54b19e146") == [12500001, "27c774c54b19e146"]  # floor, not round
    pledge = parse_pledge(encode_pledge(12.5000019, "27c774c54b19e146"))
    assert pledge == Pledge((12500001 - 1) / 1e6, "27c774c54b19e146")  # one microsecond earlier
    assert pledge_until(100.0, 1.0, 130.0) == 101.0
    assert pledge_until(100.0, 1.0, 100.5) == pytest.approx(100.0 + 0.5 / RATE_FACTOR)


def test_pledge_setting_default_range_and_lint():
    assert pledge_seconds({}, 6) == 1.0 and pledge_seconds({}, 0.5) == 0.5
    assert pledge_seconds({"leasekit_pledge_s": 0}, 6) == 0.0
    for bad in (-1, 7, "1", True, math.nan):
        with pytest.raises(ReadGateConfigError, match=r"leasekit_pledge_s=.*\[0, kv_lease_duration=6\]"):
            pledge_seconds({"leasekit_pledge_s": bad}, 6)
    (finding,) = lint_leasekit_keys({"leasekit_pledge_s": 9}, "kv_producer", 6, "kv_transfer_config")
    assert finding[:2] == ("kv_transfer_config.leasekit_pledge_s", "error")


def test_ack_carries_p_clock_reading_rounded_up_and_clock_id():
    msg = decode_notification(encode_ack(7, 2.5, ["a", "b"], 1234.0000001, "c0ffee"))
    assert msg == Ack(7, 2.5, ("a", "b"), 1234.000002, "c0ffee")  # rounded up on the wire, +1 us decoded
    assert decode_notification(encode_ack(7, 2.5, [], 1.0, None)).clock_id is None
    assert decode_notification(b"LK1:A:7:2500:a,b") == Ack(7, 2.5, ("a", "b"))  # a version-2 P's ack: no clock
    assert decode_notification(b"LK1:A:7:x:a").reason == "bad_protocol"


def _gate_with_sample(clock="p", sent=10.0, remote=1000.0, agent="agent"):
    gate = ReadGate(timeout_s=5.0, max_remaining_s=6.0)
    seq = gate.heartbeat_sent(agent, now=sent)
    gate.ack(agent, seq, 0.0, [], remote_now_s=remote, clock_id=clock, now=sent + 0.01)
    return gate


def test_samples_of_another_p_worker_never_prove_a_pledge_even_under_the_same_clock_id():
    gate = _gate_with_sample(agent="other-engine-worker")  # same clock id "p", another process
    gate.protect("d1", Pledge(1001.0, "p"))
    gate.expect("d1", "agent", "p1")
    gate.hold("d1", now=10.5)
    assert gate.resolve(now=10.5) == [], "only the read's own P worker's samples count"


def test_a_read_finished_inside_the_pledge_is_verified_with_no_wait():
    gate = _gate_with_sample()  # P's clock <= 1000 + (t - 10) * K
    gate.protect("d1", Pledge(1001.0, "p"))
    gate.expect("d1", "agent", "p1")
    assert gate.hold("d1", now=10.5) == HOLD  # bound 1000.61 < 1001
    (result,) = gate.resolve(now=10.5)
    assert (result.outcome, result.proof, result.wait_s) == ("verified", PROOF_PLEDGE, 0.0)


def test_a_read_finished_past_the_provable_pledge_waits_for_the_verdict():
    gate = _gate_with_sample()
    gate.protect("d1", Pledge(1001.0, "p"))
    gate.expect("d1", "agent", "p1")
    gate.hold("d1", now=11.0)  # bound 1001.22 >= 1001: not provable
    assert gate.resolve(now=11.0) == []
    gate.verdict("agent", "p1", False)
    assert gate.resolve(now=11.01)[0].outcome == "reaped"


def test_a_pledge_on_another_clock_or_without_samples_proves_nothing():
    gate = _gate_with_sample(clock="other")
    gate.protect("d1", Pledge(5000.0, "p"))
    gate.expect("d1", "agent", "p1")
    gate.hold("d1", now=10.1)
    assert gate.resolve(now=10.1) == []
    gate.verdict("agent", "p1", True)
    assert gate.resolve(now=10.2)[0].proof == PROOF_VERDICT


def test_a_reaped_verdict_or_a_reread_wins_over_the_pledge():
    gate = _gate_with_sample()
    gate.protect("d1", Pledge(1001.0, "p"))
    gate.expect("d1", "agent", "p1")
    gate.verdict("agent", "p1", False)
    gate.hold("d1", now=10.1)
    assert gate.resolve(now=10.1)[0].outcome == "reaped"
    gate.protect("d2", Pledge(1001.0, "p"))
    gate.expect("d2", "agent", "p1")  # the same P request again: its first read ended
    gate.hold("d2", now=10.2)
    assert gate.resolve(now=10.2)[0].outcome == "ungated"


def test_ack_horizon_is_named_as_the_proof():
    gate = ReadGate(timeout_s=5.0, max_remaining_s=6.0)
    gate.protect("d1")
    gate.expect("d1", "agent", "p1")
    seq = gate.heartbeat_sent("agent", now=1.0)
    gate.ack("agent", seq, 3.0, ["p1"])
    gate.hold("d1", now=2.0)
    assert gate.resolve(now=2.0)[0].proof == PROOF_ACK


def _pledged_worker(pledge_end):
    w = Worker()
    w.grant("r", 0.0)
    w.pledges.holds["r"] = pledge_end
    return w


def test_p_holds_the_blocks_of_an_early_completion_until_the_pledge_ends():
    import time

    now = time.perf_counter()
    w = _pledged_worker(now + 0.3)
    w.step({"d0": [b"HB:r"]})
    assert w.step({"d0": [b"r:1"]}) == set()  # completed, but the pledge holds
    assert "r" not in w.send and "r" in w.pledges.deferred
    assert w.step({"d1": [b"r:1"]}) == set()  # a second D (a hedge) is answered live, dropped
    assert w.drops() == {"duplicate": 1}
    w.step({"d0": [b"HB:r"]})
    assert "r" not in w.send, "a heartbeat must not revive a completed lease"
    assert w.exporter.get_finished_spans() == ()
    time.sleep(max(0.0, now + 0.3 - time.perf_counter()) + 0.01)
    assert w.step({}) == {"r"}
    (span,) = w.exporter.get_finished_spans()
    assert span.attributes[sc.OUTCOME] == "released" and span.attributes[sc.PLEDGE_HOLD_S] >= 0.25
    ((_, held),) = w.stats.data[PLEDGE_HOLDS]
    assert held == pytest.approx(span.attributes[sc.PLEDGE_HOLD_S])
    assert w.step({}) == set(), "released exactly once"


def test_a_completion_after_the_pledge_releases_at_once():
    w = _pledged_worker(-1.0)
    assert w.step({"d0": [b"r:1"]}) == {"r"}
    assert not w.pledges.deferred and w.stats.data[PLEDGE_HOLDS] == []


def test_acks_name_p_clock():
    w = Worker()
    w.replies.clock_id = "c0ffee"  # whatever this machine's clock is
    w.replies.agents["d0"] = None
    sent = []
    w.replies.outbox = type("Outbox", (), {"send": lambda self, agent, msg: sent.append(msg)})()
    w.grant("r", 0.0)
    w.step({"d0": [b"HB:r,LK1~5"]})
    (msg,) = sent
    ack = decode_notification(msg)
    assert ack.seq == 5 and ack.req_ids == ("r",) and ack.clock_id == "c0ffee" and ack.remote_now_s > 0


def test_a_completion_before_the_grant_reached_the_worker_is_held_until_the_grant_and_the_whole_pledge():
    import time
    from types import SimpleNamespace

    w = Worker()
    w.keeping.pledge_s = 0.3
    w.process.add("r")  # scheduled for prefill; the grant's metadata not seen yet
    assert w.step({"forger": [b"r:1"]}) == set()
    assert "r" in w.pledges.early and "r" in w.process, "nothing freed before the grant"
    assert w.step({"d0": [b"r:1"]}) == set() and w.drops() == {"duplicate": 1}
    time.sleep(0.35)
    assert w.step({}) == set(), "still not granted: still held"
    w.send["r"] = time.perf_counter() + L  # vLLM's start_load_kv applied the grant
    granted = time.perf_counter()
    w.pledges.take(now=time.perf_counter(), metadata=SimpleNamespace(reqs_to_send={"r": 0.0}, leasekit_pledges={"r": granted + 0.1},
                                       scheduler_clock=None))
    hold, _ = w.pledges.deferred["r"]
    assert hold >= granted + 0.3 * RATE_FACTOR and "r" not in w.send and "r" not in w.pledges.early
    time.sleep(max(0.0, hold - time.perf_counter()) + 0.01)
    assert w.step({}) == {"r"}


def test_an_early_completion_of_a_request_p_aborts_is_forgotten():
    w = Worker()
    w.keeping.pledge_s = 0.3
    w.process.add("r")
    w.step({"d0": [b"r:1"]})
    w.process.discard("r")  # reqs_not_processed (vLLM's start_load_kv)
    w.pledges.sweep(time.perf_counter())
    assert w.pledges.early == {} and w.step({}) == set()


def test_a_failure_recording_pledges_holds_the_step_s_grants_for_the_whole_pledge():
    import time
    from types import SimpleNamespace

    w = Worker()
    w.keeping.pledge_s = 0.5
    w.grant("r", time.perf_counter())
    before = time.perf_counter()
    w.pledges.take(now=time.perf_counter(), metadata=SimpleNamespace(reqs_to_send={"r": 0.0}, leasekit_pledges={"r": "not a number"},
                                       scheduler_clock=1.0))
    assert w.pledges.holds["r"] >= before + 0.5 * RATE_FACTOR


@pytest.mark.parametrize("until,same,low,high", [
    (0.4, True, 0.4, 0.41),  # on the scheduler's clock: until - scheduler_clock from now
    (0.4, False, 0.4 * RATE_FACTOR, 0.4 * RATE_FACTOR + 0.01),  # another clock: stretched by K
    (math.inf, True, 0.5 * RATE_FACTOR, 0.5 * RATE_FACTOR + 0.01),  # not finite: the whole W * K
    (1e9, True, 0.5 * RATE_FACTOR, 0.5 * RATE_FACTOR + 0.01),  # longer than W * K: capped
])
def test_pledge_holds_on_the_worker(until, same, low, high):
    import time
    from types import SimpleNamespace

    w = Worker()
    w.keeping.pledge_s = 0.5
    w.pledges.clock_id = "c0ffee"
    w.grant("r", time.perf_counter())
    before = time.perf_counter()
    w.pledges.take(now=time.perf_counter(), metadata=SimpleNamespace(reqs_to_send={"r": 0.0}, leasekit_pledges={"r": 10.0 + until},
                                       scheduler_clock=10.0, leasekit_pledge_clock="c0ffee" if same else "other"))
    assert before + low <= w.pledges.holds["r"] <= time.perf_counter() + high


def test_the_id_reaches_vllm_even_when_release_telemetry_fails():
    w = Worker()
    w.pledges.deferred["r"] = (0.0, 0.0)
    w.pledges.stats = None  # pledge_hold() now raises
    assert w.step({}) == {"r"}


def test_a_parked_completion_whose_grant_never_comes_is_forgotten_after_the_max_hold():
    w = Worker(max_hold_s=6.0)
    w.process.add("r")
    w.step({"d0": [b"r:1"]})
    w.pledges.early["r"] -= 7.0
    w.pledges.sweep(time.perf_counter())
    assert w.pledges.early == {} and "r" not in w.state.consumer_counts


def test_counts_of_a_completion_before_a_grant_that_never_comes_are_forgotten():
    """A counted completion (``n = 2``) for a request still prefilling that P then aborts: vLLM keeps its
    count for ever (stock too); P's sweep drops it once the request is neither live nor prefilling."""
    w = Worker()
    w.process.add("r")
    w.step({"d0": [b"r:2"]})
    assert w.state.consumer_counts["r"] == 1
    w.process.discard("r")  # aborted on P
    w.pledges.sweep(time.perf_counter())
    assert "r" not in w.state.consumer_counts


def test_lint_reports_every_bad_leasekit_value_at_once():
    """A bad max hold does not hide a bad notification size (or the pledge): one lint run names each."""
    found = lint_leasekit_keys({"leasekit_max_hold_s": 1, "leasekit_max_notification_bytes": 10, "leasekit_pledge_s": 99},
                               "kv_producer", 6, "kv_transfer_config")
    fields = sorted(f for f, severity, *_ in found if severity == "error")
    assert fields == ["kv_transfer_config.leasekit_max_hold_s", "kv_transfer_config.leasekit_max_notification_bytes",
                      "kv_transfer_config.leasekit_pledge_s"]
