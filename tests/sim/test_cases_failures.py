"""Incident classes K11-K13 in virtual time: failed handshakes end in time, exact counters, crafted reads caught."""

import pytest

from leasekit.sim import RequestSpec, World, WorldConfig
from leasekit.sim import invariants as inv
from leasekit.sim.bus import fail_sends


# -- K11 P dies during D's handshake -------------------------------------------------------------
@pytest.mark.parametrize("handshake_s, retries, p_dies", [(1.0, 3, 0.5), (0.2, 5, 0.1)])
def test_k11_p_dies_during_the_handshake_and_the_request_fails_in_bounded_time(handshake_s, retries, p_dies):
    w = World(WorldConfig(latency_s=0.001, d_handshaken=False, handshake_s=handshake_s, handshake_retries=retries))
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.0))
    w.kill_p(p_dies)
    w.run(60)
    record = w.requests["R"]
    assert record.d_outcome == "failed"  # recompute or error per kv_load_failure_policy
    assert record.d_outcome_true <= (retries + 1) * (handshake_s + w.config.d_tick_s)
    assert w.counters["handshake_failures"] == retries
    assert w.d_alive


# -- K12 counters that mean one thing ------------------------------------------------------------
@pytest.mark.parametrize("L, p_tp", [(30, 8), (60, 8), (30, 2), (12, 4)])
def test_k12_each_counter_has_its_declared_value(L, p_tp):
    w = World(WorldConfig(lease_duration_s=L, p_tp=p_tp, d_tp=p_tp, latency_s=0.001, max_running=0))
    for i in range(3):
        w.add(RequestSpec(f"OK{i}", prefill_end_s=0.0, route_delay_s=0.1))
    for i in range(2):
        w.add(RequestSpec(f"EXP{i}", prefill_end_s=0.0, route_delay_s=None))
    w.add(RequestSpec("LATE", prefill_end_s=0.0, route_delay_s=None))
    w.add(RequestSpec("XFER", prefill_end_s=0.0, route_delay_s=0.1, read_fails=True))
    # D heartbeats OK0-2 and XFER from t=0.1; exactly 4 batches reach P; the 5th batch fails to send
    # on every D rank, and right after it D admits everything queued.
    batch_times: list[float] = []

    def fifth_batch(m):
        if m.kind != "heartbeat":
            return False
        if m.sent_at_s not in batch_times:
            batch_times.append(m.sent_at_s)
            if len(batch_times) == 5:
                w.at(m.sent_at_s + 0.05, lambda world: setattr(world.config, "max_running", 100))
        return len(batch_times) == 5 and m.sent_at_s == batch_times[4]

    w.bus.rules.append(fail_sends(fifth_batch))
    w.at(1.5 * L, lambda world: world._route_at(world.requests["LATE"], world.now))  # read after its expiry
    w.run(4 * L)
    per_rank = {k: sum(t.counters[k] for t in w.tables) for k in ("granted", "released", "expired", "late_completions", "extended")}
    assert per_rank["granted"] == 7 * p_tp
    assert per_rank["released"] == 3 * p_tp  # OK0-2
    assert per_rank["expired"] == 4 * p_tp  # EXP0-1, LATE, and XFER (P never heard back)
    assert per_rank["late_completions"] == 1 * p_tp  # LATE's read, once per P rank
    assert per_rank["extended"] == 4 * 4 * p_tp  # 4 batches x 4 waiting requests x P ranks
    assert w.counters["transport_failures"] == 1  # per request, and never an expiry
    # per batch (D engine): 4 delivered, the failed 5th, and LATE's own batch after its expiry
    assert w.counters["heartbeat_batches"] == 6
    assert w.counters["heartbeat_send_failures"] == p_tp  # per D rank send: one failed batch
    assert w.counters["unknown_heartbeat_ids"] == p_tp  # LATE's batch named an ended lease: per rank
    assert w.counters["stale_reads_detected"] == 1  # LATE
    assert sum(r.d_outcome == "served" for r in w.requests.values()) == 3


# -- K13 a fault matrix of crafted kv_transfer_params --------------------------------------------
@pytest.mark.parametrize("L", [30, 12])
@pytest.mark.parametrize("row", ["unknown_id", "bad_blocks", "consumed", "reused", "expired"])
def test_k13_every_crafted_read_is_detected_and_counted(row, L):
    w = World(WorldConfig(lease_duration_s=L, latency_s=0.001, max_running=1 << 10))
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.01 if row in ("consumed", "reused") else None))
    if row == "reused":
        w.add(RequestSpec("OTHER", prefill_end_s=2.0, route_delay_s=None))  # takes R's freed blocks
    spec = {
        "unknown_id": RequestSpec("X", prefill_end_s=1.0, blocks=0, route_delay_s=0.01, remote_of="no-such-request"),
        "bad_blocks": RequestSpec("X", prefill_end_s=1.0, blocks=0, route_delay_s=0.01, remote_of="R", bad_blocks=True),
        "consumed": RequestSpec("X", prefill_end_s=1.0, blocks=0, route_delay_s=0.01, remote_of="R"),
        "reused": RequestSpec("X", prefill_end_s=3.0, blocks=0, route_delay_s=0.01, remote_of="R"),
        "expired": RequestSpec("X", prefill_end_s=1.0, blocks=0, route_delay_s=1.5 * L - 1.0, remote_of="R"),  # read at 1.5 L
    }[row]
    w.add(spec)
    w.run(3 * L)
    x = w.requests["X"]
    assert x.d_outcome == "stale_detected"
    assert x.read_result == {"unknown_id": "invalid", "bad_blocks": "invalid", "consumed": "freed",
                             "reused": "reused", "expired": "freed"}[row]
    assert w.counters["stale_reads_detected"] == 1
    assert inv.fail_closed(w) == []
