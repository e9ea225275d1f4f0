"""LeaseBinding: only the bound agent (plus admitted co-consumers) moves a lease."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leasekit.lease.binding import COUNTED, DUPLICATE, FOREIGN, MAX_CONSUMERS, RELEASED, LeaseBinding


def test_first_heartbeat_binds_and_other_agents_are_foreign():
    b = LeaseBinding()
    assert b.heartbeat("r", "d0")
    assert b.bound_agent("r") == "d0"
    assert not b.heartbeat("r", "forger")
    assert b.heartbeat("r", "d0")


def test_forged_single_consumer_completion_cannot_release():
    b = LeaseBinding()
    b.heartbeat("r", "d0")
    assert b.completion("r", "forger", 1) == FOREIGN
    assert "r" in b
    assert b.completion("r", "d0", 1) == RELEASED
    assert "r" not in b


def test_duplicate_completion_from_one_agent_does_not_count_twice():
    b = LeaseBinding()
    assert b.completion("r", "d0", 2) == COUNTED
    assert b.completion("r", "d0", 2) == DUPLICATE
    assert b.completion("r", "d1", 2) == RELEASED


def test_multi_consumer_needs_the_bound_agent():
    b = LeaseBinding()
    b.heartbeat("r", "d0")
    assert b.completion("r", "x1", 2) == COUNTED
    assert b.completion("r", "x2", 2) == COUNTED  # two foreign agents claiming n=2: not enough
    assert "r" in b
    assert b.completion("r", "d0", 2) == RELEASED


def test_expected_count_comes_from_the_bound_agent():
    b = LeaseBinding()
    b.heartbeat("r", "d0")
    assert b.completion("r", "d1", 2) == COUNTED  # sibling D rank of a TP-2 decode
    assert b.completion("r", "d0", 2) == RELEASED


def test_consumer_cap():
    b = LeaseBinding()
    b.heartbeat("r", "d0")
    for i in range(MAX_CONSUMERS):
        assert b.completion("r", f"x{i}", 1000) == COUNTED
    assert b.completion("r", "one-too-many", 1000) == FOREIGN


def test_forget_and_retain():
    b = LeaseBinding()
    for r in ("a", "b", "c"):
        b.heartbeat(r, "d0")
    b.forget("a")
    b.forget("a")
    assert b.retain({"b"}) == 1
    assert len(b) == 1 and "b" in b


def test_bad_count_is_an_error():
    with pytest.raises(ValueError, match="expected_consumers"):
        LeaseBinding().completion("r", "d0", 0)


@given(st.lists(st.tuples(st.sampled_from(["hb", "done"]), st.sampled_from(["x1", "x2", "x3"]),
                          st.integers(1, 4)), max_size=40))
def test_no_sequence_of_foreign_messages_releases_a_bound_lease(messages):
    b = LeaseBinding()
    b.heartbeat("r", "d0")
    for kind, agent, n in messages:
        if kind == "hb":
            assert not b.heartbeat("r", agent)
        else:
            assert b.completion("r", agent, n) != RELEASED
    assert b.bound_agent("r") == "d0"
