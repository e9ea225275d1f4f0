"""pytest plugin for vLLM's own connector unit tests, loaded with ``-p lk_upstream_plugin`` in the
vLLM source tree (``tests/upstream/run_vllm_nixl_tests.py`` starts those runs; this directory is put
on ``PYTHONPATH`` so that the name does not clash with vLLM's own ``tests`` package).

Both runs (stock and LeaseKit) load it, so they differ only in the substitution:

- ``LEASEKIT_UPSTREAM_DEPS`` (a directory): appended to ``sys.path`` (after site-packages, so the
  project's own packages win) for the imports vLLM's tests need beyond the project's: ``ray``
  (``test_nixl_connector.py``), ``tblib`` (``tests/conftest.py``).
- ``LEASEKIT_UPSTREAM_SUBSTITUTE=1``: at ``pytest_configure`` (before any test module is imported) the
  module attributes listed in :data:`SUBSTITUTIONS` are set to LeaseKit's classes, so the upstream
  tests' ``from vllm...nixl import NixlConnector, NixlConnectorWorker, NixlConnectorScheduler``, the
  connector factory's lazy ``getattr(module, "NixlConnector")``, ``mock.patch("vllm...nixl.<module>.<Class>...")``
  strings and ``NixlPullConnector``'s own ``isinstance`` checks all reach LeaseKit's classes. No
  upstream file and no assertion is changed.
- ``LEASEKIT_UPSTREAM_OUTCOMES`` (a file): one JSON object ``{node id: outcome}`` written at session
  end; outcome is ``passed``, ``failed`` (any phase failed: setup, call or teardown), ``skipped``,
  ``xfailed`` or ``xpassed``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest

DEPS_ENV = "LEASEKIT_UPSTREAM_DEPS"
SUBSTITUTE_ENV = "LEASEKIT_UPSTREAM_SUBSTITUTE"
OUTCOMES_ENV = "LEASEKIT_UPSTREAM_OUTCOMES"

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
CONNECTOR, WORKER, SCHEDULER = "LeaseKitConnector", "LeaseKitPullWorker", "LeaseKitPullScheduler"

SUBSTITUTIONS: dict[str, dict[str, str]] = {
    # the package's re-exports (what the tests import)
    NIXL: {"NixlConnector": CONNECTOR, "NixlPullConnector": CONNECTOR,
           "NixlConnectorWorker": WORKER, "NixlPullConnectorWorker": WORKER,
           "NixlConnectorScheduler": SCHEDULER, "NixlPullConnectorScheduler": SCHEDULER},
    # the factory's registry entry ("NixlConnector" / "NixlPullConnector" -> this module) and the
    # names NixlPullConnector's own methods read (start_load_kv's isinstance check)
    f"{NIXL}.connector": {"NixlConnector": CONNECTOR, "NixlPullConnector": CONNECTOR,
                          "NixlPullConnectorWorker": WORKER, "NixlPullConnectorScheduler": SCHEDULER},
    # backward-compatible aliases (vllm 0.32.0 nixl/worker.py, nixl/scheduler.py)
    f"{NIXL}.worker": {"NixlConnectorWorker": WORKER, "NixlPullConnectorWorker": WORKER},
    f"{NIXL}.scheduler": {"NixlConnectorScheduler": SCHEDULER, "NixlPullConnectorScheduler": SCHEDULER},
    # the defining modules (mock.patch targets spelled with the defining module)
    f"{NIXL}.pull_worker": {"NixlPullConnectorWorker": WORKER},
    f"{NIXL}.pull_scheduler": {"NixlPullConnectorScheduler": SCHEDULER},
}
"""Module -> {vLLM attribute: LeaseKit class name in ``leasekit.vllm.connector``}."""

_deps = os.environ.get(DEPS_ENV)
if _deps and _deps not in sys.path:
    sys.path.append(_deps)


def substitute() -> list[str]:
    """Set every attribute of :data:`SUBSTITUTIONS` to LeaseKit's class; returns ``module.attr``
    names done.

    Raises:
        AttributeError: a listed attribute is missing in the installed vLLM (a release whose layout
            differs: the substitution would silently test stock code).
    """
    leasekit_connector = importlib.import_module("leasekit.vllm.connector")
    done = []
    for module_name, attrs in SUBSTITUTIONS.items():
        module = importlib.import_module(module_name)
        for attr, leasekit_name in attrs.items():
            if not hasattr(module, attr):
                raise AttributeError(f"{module_name} has no {attr}: cannot substitute {leasekit_name}")
            setattr(module, attr, getattr(leasekit_connector, leasekit_name))
            done.append(f"{module_name}.{attr}")
    return done


_OUTCOMES: dict[str, str] = {}
_RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "xpassed": 1, "failed": 2}
_SUBSTITUTED: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """Substitute (when asked) before collection imports the test modules."""
    if os.environ.get(SUBSTITUTE_ENV) == "1":
        _SUBSTITUTED[:] = substitute()


def pytest_report_header(config: pytest.Config) -> str:
    """One line: which classes the run tests."""
    if _SUBSTITUTED:
        return f"leasekit: {len(_SUBSTITUTED)} vLLM NIXL attributes -> LeaseKit classes"
    return "leasekit: stock vLLM NIXL classes"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Check that the substitution is still in place when the session starts."""
    if _SUBSTITUTED:
        leasekit_connector = sys.modules["leasekit.vllm.connector"]
        assert sys.modules[NIXL].NixlConnector is leasekit_connector.LeaseKitConnector, "substitution undone"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Fold the setup/call/teardown reports into one outcome per node id (the worst phase wins)."""
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    else:
        outcome = "failed" if report.failed else "skipped" if report.skipped else "passed"
    if _RANK[outcome] >= _RANK[_OUTCOMES.get(report.nodeid, "passed")]:
        _OUTCOMES[report.nodeid] = outcome


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the outcomes file (``LEASEKIT_UPSTREAM_OUTCOMES``)."""
    path = os.environ.get(OUTCOMES_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_OUTCOMES, f, indent=0, sort_keys=True)
