"""A deterministic virtual-time P/D model over :mod:`leasekit.lease` (milliseconds per case).

For the incident timelines (classes K01-K13, ``tests/sim/test_cases_*.py``) and property tests:
per-process clocks with offsets and rates, a notification bus that can drop, delay, duplicate and
reorder, a D scheduler with admission rate, queue and forward-pass lengths, TP fan-out, kill and
restart, and per-rank KV block pools with generation counters so a read of freed or reused blocks
is always detected. Pull mode (D READs, then notifies P) by default; push mode
(``WorldConfig(transfer_mode="push")``: D registers its blocks, P WRITEs them, :mod:`leasekit.sim.push`,
checkers in :mod:`leasekit.sim.push_invariants`).
The sim is a tool for the protocol; it does not replace the real pair.
"""

from leasekit.sim.records import RequestSpec, WorldConfig
from leasekit.sim.world import World

__all__ = ["RequestSpec", "World", "WorldConfig"]
