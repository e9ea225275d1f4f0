"""Shared fixtures. Tests marked ``pair`` start real vLLM servers (tens of seconds each); they fail,
not skip, when vLLM is missing, unless ``LEASEKIT_SKIP_PAIR=1`` says so explicitly. ``shared_pair``
is one such pair that several modules share (:mod:`tests.shared_pair`)."""

import os

import pytest

from leasekit.chaos.suite import signals_deferred
from tests.prefetch import PREFETCH
from tests.shared_pair import SharedPair


@pytest.fixture(scope="session")
def vllm_available():
    """Import vLLM once; fail (or skip when LEASEKIT_SKIP_PAIR=1) if the CPU stack is missing."""
    try:
        import nixl  # noqa: F401
        import vllm  # noqa: F401
    except ImportError as exc:
        if os.environ.get("LEASEKIT_SKIP_PAIR") == "1":
            pytest.skip(f"LEASEKIT_SKIP_PAIR=1 and the vLLM CPU stack is missing ({exc})")
        pytest.fail(f"the vLLM CPU stack is missing ({exc}); run ./setup.sh (or set LEASEKIT_SKIP_PAIR=1)")
    return True


_SHARED = SharedPair()


@pytest.fixture(scope="module")
def shared_pair(vllm_available, tmp_path_factory):
    """The real LeaseKit P/D pair of :mod:`tests.shared_pair` (L = 6 s, P's max hold 12 s), started on
    first use (or again if the last user left P or D unhealthy) and shared across modules."""
    return _SHARED.get(lambda: tmp_path_factory.mktemp("shared-pair") / "run")


@pytest.hookimpl(trylast=True)  # after pytest tore down this test's fixtures (a module's NIXL peer first)
def pytest_runtest_teardown(item, nextitem):
    """Stop the shared pair once the next test does not use it, so it never runs beside another pair."""
    if nextitem is None or "shared_pair" not in nextitem.fixturenames:
        _SHARED.stop()


def pytest_sessionfinish(session, exitstatus):
    """Stop the shared pair if the session ended early (interrupted, ``-x``), and every prefetched
    pair that no test claimed."""
    with signals_deferred(raise_after=False):  # a second SIGINT/SIGTERM must not cut the stops short
        _SHARED.stop()
        PREFETCH.stop()


def pytest_runtest_setup(item):
    """When the last test of a module starts (or the first of a module that lists pairs), launch
    the next module's ``PREFETCH_PAIRS`` in the background."""
    items = item.session.items
    index = items.index(item) if item in items else -1
    if index < 0 or os.environ.get("LEASEKIT_SKIP_PAIR") == "1":
        return
    first = index == 0 or items[index - 1].module is not item.module
    ahead = [item] if first else []
    if index + 1 < len(items) and items[index + 1].module is not item.module:
        ahead.append(items[index + 1])
    for upcoming in ahead:
        specs = getattr(upcoming.module, "PREFETCH_PAIRS", None)
        if specs:
            factory = item.session.config._tmp_path_factory  # noqa: SLF001 - pytest's own tmp_path_factory
            PREFETCH.prefetch(list(specs), lambda: factory.mktemp("prefetched-pair") / "run")


TWO_HOST_TEST = "tests/integration/test_two_hosts.py::test_verdict_on_two_ssh_hosts_is_the_catalogs"
_CATALOG_AS_IS = ("--leasekit-pair", "--leasekit-lease-duration", "--leasekit-catalog", "--leasekit-prefill-url",
                  "--leasekit-target")


STOCK_BASELINE = ("kill-decode",)
"""Stock cases the tests run although stock is expected to PASS them: the baseline that the stock
connector's evidence (P's DEBUG lease log) yields a passing verdict on this pair."""
ALL_STOCK_CASES = "LEASEKIT_STOCK_CASES"
"""``LEASEKIT_STOCK_CASES=all`` runs every stock case of the catalog in the tests too."""


def _stock_case_kept(scenario) -> bool:
    """Whether the tests run ``scenario`` on the stock target by default: where its expected stock
    verdict is not PASS (a known vLLM defect, an expected FAIL; or a fault the stock connector cannot
    take, UNKNOWN without a pair), and the :data:`STOCK_BASELINE`. The main job
    (``leasekit chaos run --all``) runs every stock case."""
    return scenario.expect.verdict_for("stock") != "PASS" or scenario.name in STOCK_BASELINE


def _shared_pair_users_together(items) -> None:
    """Move every test that uses ``shared_pair`` next to the first one (order kept otherwise): the
    shared pair is stopped when the next test does not use it, so a module between two of its users
    would cost a pair start."""
    users = [item for item in items if "shared_pair" in getattr(item, "fixturenames", ())]
    if not users:
        return
    first = items.index(users[0])
    moved = {id(item) for item in users}
    rest = [item for item in items if id(item) not in moved]
    items[:] = rest[:first] + users + rest[first:]


@pytest.hookimpl(trylast=True)  # after -m / -k deselected what they deselect
def pytest_collection_modifyitems(config, items):
    """Run each catalog case once a session: a scenario and target that the two-host test runs on
    two SSH hosts (P and D on separate hosts, the more faithful deployment) is not run again by the
    one-host catalog test; on the stock target, only the cases :func:`_stock_case_kept` keeps (CI's
    time budget; ``LEASEKIT_STOCK_CASES=all`` keeps every one). Only for the default catalog on the
    default CPU pair at its own L: with ``--leasekit-pair``, ``--leasekit-lease-duration``,
    ``--leasekit-catalog``, ``--leasekit-target`` or a running pair the catalog test runs every case.
    Tests sharing the shared pair run one after the other."""
    _shared_pair_users_together(items)
    if any(config.getoption(option) for option in _CATALOG_AS_IS):
        return
    all_stock = os.environ.get(ALL_STOCK_CASES, "").strip().lower() == "all"
    on_two_hosts = set()
    for item in items:
        if item.nodeid.split("[")[0] == TWO_HOST_TEST:
            name, target = item.callspec.params["name"], item.callspec.params["target"]
            if target in item.module.TARGETS and name in item.module._selected():
                on_two_hosts.add((name, target))
    keep, dropped = [], []
    for item in items:
        case = getattr(item, "callspec", None) and item.callspec.params.get("chaos_case")
        stock_cut = bool(case) and case[1] == "stock" and not all_stock and not _stock_case_kept(case[0])
        (dropped if case and ((case[0].name, case[1]) in on_two_hosts or stock_cut) else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
