"""The check every incident-class world of tests/sim/test_cases_*.py ends with: the always-true invariants."""

from leasekit.sim import World
from leasekit.sim import invariants as inv


def assert_invariants(world: World, quiescent: bool = True) -> None:
    """Bounded and not-premature reclaim, reaper completeness, fail closed, idempotent release and, once quiet
    (``quiescent``), conservation."""
    assert inv.check_all(world, quiescent=quiescent) == {}
