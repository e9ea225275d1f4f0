"""The lease timeline PNG: written headless, a valid PNG that matplotlib reads back, a sane size."""

import math

import matplotlib.image as mpimg
import pytest

from leasekit.chaos.plot import plot_timeline
from leasekit.telemetry.lease_timeline import LeaseTimeline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GRANT0 = 5000.0


def lease(i, outcome, *, grant, end, hbs=(), events=(), tp_rank=0):
    hbs = tuple(grant + h for h in hbs)
    return LeaseTimeline(
        request_id=f"cmpl-{i:04d}", engine_id="P", tp_rank=tp_rank, kv_blocks=2, lease_duration_s=6.0,
        extension_s=4.0, grant_s=grant, initial_deadline_s=grant + 6, heartbeats_s=hbs, heartbeat_count=len(hbs),
        last_heartbeat_s=hbs[-1] if hbs else None, deadline_s=max(grant + 6, (hbs[-1] + 4) if hbs else 0),
        end_s=end, outcome=outcome, retrievals=0, step_gap_s=None, remote_agent=None,
        events=tuple((name, grant + t) for name, t in events),
    )


def sample(n):
    outcomes = ["released", "expired", "aborted", "open"]
    out = []
    for i in range(n):
        grant = GRANT0 + 0.2 * i
        outcome = outcomes[i % 4]
        hbs = tuple(1.0 + k for k in range(i % 5))
        last = hbs[-1] if hbs else 0.0
        end = grant + (max(6.0, last + 4.0) + 0.1 if outcome == "expired" else 2.0 + (i % 7))
        events = (("late_read", end - grant + 1.0),) if outcome == "expired" and i % 8 == 1 else ()
        out.append(lease(i, outcome, grant=grant, end=end, hbs=hbs, events=events))
    return out


def check_png(path, min_bytes=5_000, max_bytes=3_000_000):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert min_bytes < len(data) < max_bytes, len(data)
    image = mpimg.imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 500
    return image


def test_four_outcomes_heartbeats_faults_and_bounds(tmp_path):
    leases = sample(8)
    bounds = {t.request_id: t.deadline_s - t.grant_s + 0.5 for t in leases}
    result = plot_timeline(
        tmp_path / "plots" / "timeline.png", leases, title="kill-decode (stock)",
        fault_windows=[(GRANT0 + 3.0, GRANT0 + 3.0, "SIGKILL D"), (GRANT0 + 1.0, GRANT0 + 2.5, "stall D")],
        bounds=bounds, clock_note="P wall clock, vLLM log records",
    )
    assert (result.leases_drawn, result.skipped) == (8, 0)
    check_png(result.path)


def test_zero_leases_draws_an_empty_chart(tmp_path):
    result = plot_timeline(tmp_path / "empty.png", [], title="nothing", fault_windows=[], bounds=None, clock_note="")
    assert result.leases_drawn == 0
    check_png(result.path, min_bytes=2_000)


def test_fifty_leases(tmp_path):
    leases = sample(50)
    result = plot_timeline(tmp_path / "fifty.png", leases, title="50 leases",
                           fault_windows=[(GRANT0 + 4, GRANT0 + 12, "partition")],
                           bounds={t.request_id: 6.5 for t in leases}, clock_note="P monotonic")
    image = check_png(result.path)
    assert result.leases_drawn == 50
    assert image.shape[0] > image.shape[1]  # one row per lease: taller than wide


def test_malformed_leases_and_windows_are_skipped(tmp_path):
    good = lease(1, "released", grant=GRANT0, end=GRANT0 + 3, hbs=(1.0,), tp_rank=1)
    other_rank = lease(1, "released", grant=GRANT0, end=GRANT0 + 3, tp_rank=0)
    bad = [lease(2, "expired", grant=GRANT0, end=math.nan), lease(3, "expired", grant=GRANT0, end=GRANT0 - 1), "junk"]
    result = plot_timeline(tmp_path / "m.png", [good, other_rank, *bad], title="m",
                           fault_windows=[(math.inf, 1.0, "bad"), ("x",), (GRANT0, GRANT0 + 1, "ok")],
                           bounds={"cmpl-0001": math.nan}, clock_note="")
    assert (result.leases_drawn, result.skipped) == (2, 3)
    check_png(result.path)


@pytest.mark.parametrize("n", [200])
def test_many_leases_stay_bounded_in_size(tmp_path, n):
    result = plot_timeline(tmp_path / "many.png", sample(n), title="many", clock_note="")
    image = check_png(result.path)
    assert image.shape[0] <= 60 * 100 + 1
