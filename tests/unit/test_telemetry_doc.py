"""docs/telemetry.md names every metric leasekit exports and every drop ``reason`` (an operator reads the
table to know what a series means)."""

from pathlib import Path

import pytest

from leasekit.telemetry import metrics as m

DOC = (Path(__file__).resolve().parents[2] / "docs" / "telemetry.md").read_text()
SPECS = [v for v in vars(m).values() if isinstance(v, m.MetricSpec)]


def _documented(spec: m.MetricSpec) -> bool:
    exposed = spec.name + ("_total" if spec.kind == "counter" and not spec.name.endswith("_total") else "")
    short = "..._" + exposed.removeprefix("leasekit_kv_lease_")  # a row naming several: `a`, `..._b`
    return f"`{exposed}`" in DOC or f"`{short}`" in DOC


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_every_metric_is_in_the_telemetry_doc(spec):
    assert len(SPECS) > 20
    assert _documented(spec), f"{spec.name} ({spec.kind}) is not in docs/telemetry.md"


@pytest.mark.parametrize("reason", m.NOTIFICATION_DROP_REASONS)
def test_every_drop_reason_is_in_the_telemetry_doc(reason):
    assert f"`{reason}`" in DOC, f"drop reason {reason!r} is not in docs/telemetry.md"
