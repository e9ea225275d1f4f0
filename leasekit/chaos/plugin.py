"""pytest plugin (entry point ``pytest11: leasekit``): the chaos catalog as tests.

Markers: ``chaos`` (runs a scenario on a real P/D pair), ``gpu`` (needs an NVIDIA GPU; skipped
where ``nvidia-smi`` finds none), ``pair`` (starts real vLLM servers).

Fixtures:
    ``leasekit_suite`` (session): a :class:`leasekit.chaos.suite.Suite` whose pool starts pairs on
        demand and shares them between tests; at session end it tears everything down and writes
        ``report.json`` and ``junit.xml`` under ``--leasekit-run-dir``.
    ``chaos_case``: one ``(Scenario, target)``; a test that asks for it is parametrised over the
        catalog in run order (pairs shared; scenarios that kill a server last), ids ``name[target]``.
    ``leasekit_pair`` (session): a started pair (LeaseKitConnector on both sides, L = 6 s) for
        tests of your own, or the external pair.

Options: ``--leasekit-catalog DIR``, ``--leasekit-target leasekit|stock`` (repeatable),
``--leasekit-scenario NAME`` (repeatable), ``--leasekit-run-dir DIR``, ``--leasekit-lease-duration S``,
``--leasekit-pair FILE`` (a pair file: the deployment the pairs are started as; checked on its hosts
at configure time, before any server starts);
and to use an already running pair instead of starting one: ``--leasekit-prefill-url``,
``--leasekit-decode-url``, ``--leasekit-pair-dir`` (the connectors' ``leasekit_run_dir``), with
``--leasekit-pair-target`` and ``--leasekit-lease-duration`` describing it (see
:mod:`leasekit.cluster.external`). Scenarios an external pair cannot serve are skipped with the reason.
"""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
from pathlib import Path

import pytest

from leasekit.chaos.scenario import ScenarioError, find_scenario, list_scenarios


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the ``--leasekit-*`` options."""
    group = parser.getgroup("leasekit", "leasekit chaos suite")
    group.addoption("--leasekit-catalog", help="scenario directory (default: chaos/ or $LEASEKIT_CHAOS_DIR)")
    group.addoption("--leasekit-target", action="append", choices=("leasekit", "stock"),
                    help="run scenarios only against this target (repeatable)")
    group.addoption("--leasekit-scenario", action="append", metavar="NAME", help="only this scenario (repeatable)")
    group.addoption("--leasekit-run-dir", help="where pairs, spans and the suite's report go (default runs/pytest-<time>)")
    group.addoption("--leasekit-lease-duration", type=float, help="kv_lease_duration override in seconds (0 < L <= 3600)")
    group.addoption("--leasekit-prefill-url", help="use this running P instead of starting a pair")
    group.addoption("--leasekit-decode-url", help="use this running D instead of starting a pair")
    group.addoption("--leasekit-pair-dir", help="the running pair's leasekit_run_dir (spans/, faults/)")
    group.addoption("--leasekit-pair-target", choices=("leasekit", "stock"), default="leasekit",
                    help="which connector the running pair uses")
    group.addoption("--leasekit-prefill-log", help="the running P's log file (stock target evidence)")
    group.addoption("--leasekit-pair", metavar="FILE", help="pair file (pairs/*.toml) describing the P/D deployment to start")


_DEPLOYMENT = pytest.StashKey[object]()


def deployment(config: pytest.Config):
    """The ``--leasekit-pair`` file as a :class:`leasekit.cluster.pairfile.PairFile`, or None.

    Raises:
        pytest.UsageError: the file is missing or invalid.
    """
    if _DEPLOYMENT not in config.stash:
        path = config.getoption("--leasekit-pair")
        value = None
        if path:
            from leasekit.cluster.pairfile import PairFileError, load_pair_file

            try:
                value = load_pair_file(path)
            except PairFileError as exc:
                raise pytest.UsageError(f"--leasekit-pair: {exc}") from None
        config.stash[_DEPLOYMENT] = value
    return config.stash[_DEPLOYMENT]


def _lease_duration(config: pytest.Config) -> float | None:
    """``--leasekit-lease-duration``, else the pair file's ``lease_duration_s``, else None."""
    duration = config.getoption("--leasekit-lease-duration")
    if duration is None and deployment(config) is not None:
        duration = deployment(config).lease_duration_s
    return int(duration) if duration is not None and float(duration).is_integer() else duration


def pytest_configure(config: pytest.Config) -> None:
    """Declare the markers (so ``--strict-markers`` accepts them)."""
    for line in (
        "chaos: a chaos scenario against a real P/D pair",
        "gpu: needs an NVIDIA GPU (skipped where nvidia-smi finds none)",
        "pair: starts real vLLM P/D servers on this host (slow: tens of seconds per start)",
    ):
        config.addinivalue_line("markers", line)
    _external(config)  # refuse half-given pair options before collection
    duration = config.getoption("--leasekit-lease-duration")
    if duration is not None and not 0 < duration <= 3600:
        raise pytest.UsageError(f"--leasekit-lease-duration must satisfy 0 < seconds <= 3600, got {duration}")
    if deployment(config) is not None:
        if _external(config):
            raise pytest.UsageError("--leasekit-pair starts its own pair; --leasekit-prefill-url/--leasekit-decode-url "
                                    "use a running one: pass one or the other")
        from leasekit.chaos.plan import tools_needed
        from leasekit.cluster.deploy import require_local
        from leasekit.cluster.pairfile import PairFileError
        from leasekit.cluster.preflight import preflight

        try:  # before any server starts
            require_local(deployment(config))
            preflight(deployment(config), tools=tools_needed(planned_cases(config)))
        except PairFileError as exc:
            raise pytest.UsageError(f"--leasekit-pair {config.getoption('--leasekit-pair')}: {exc}") from None


def gpu_available() -> bool:
    """Whether ``nvidia-smi -L`` lists at least one GPU."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests on machines without a GPU."""
    if not any(item.get_closest_marker("gpu") for item in items) or gpu_available():
        return
    skip = pytest.mark.skip(reason="gpu: no NVIDIA GPU on this machine (nvidia-smi -L lists none)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def _external(config: pytest.Config) -> bool:
    urls = [config.getoption("--leasekit-prefill-url"), config.getoption("--leasekit-decode-url")]
    if any(urls) and not all(urls):
        raise pytest.UsageError("--leasekit-prefill-url and --leasekit-decode-url go together")
    if all(urls) and not config.getoption("--leasekit-pair-dir"):
        raise pytest.UsageError("--leasekit-pair-dir is needed with a running pair (its leasekit_run_dir: spans/, faults/)")
    return all(urls)


def planned_cases(config: pytest.Config) -> list:
    """``[(Scenario, target)]`` from the options, in the suite's run order.

    Raises:
        pytest.UsageError: an unknown or invalid scenario, or a bad override (message names it).
    """
    from leasekit.chaos.suite import plan

    catalog = config.getoption("--leasekit-catalog")
    directory = Path(catalog) if catalog else None
    names = config.getoption("--leasekit-scenario") or list(list_scenarios(directory))
    duration = _lease_duration(config)
    try:
        scenarios = [find_scenario(n, directory).with_overrides(lease_duration_s=duration) for n in names]
    except ScenarioError as exc:
        raise pytest.UsageError(str(exc)) from None
    targets = config.getoption("--leasekit-target")
    if _external(config):
        targets = [config.getoption("--leasekit-pair-target")]
    return plan(scenarios, targets)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise ``chaos_case`` over the planned catalog."""
    if "chaos_case" in metafunc.fixturenames:
        cases = planned_cases(metafunc.config)
        metafunc.parametrize("chaos_case", cases, ids=[f"{s.name}[{t}]" for s, t in cases])


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last catalog case in a row, stop the suite's pairs and spares (vLLM engines
    busy-poll even when idle: left running, they would perturb every later test's timing)."""
    if "chaos_case" in getattr(item, "fixturenames", ()) and (
        nextitem is None or "chaos_case" not in getattr(nextitem, "fixturenames", ())
    ):
        for suite in _SUITES:
            suite.pool.close()


_SUITES: list = []
"""Suites of this session, so an interrupt can mark them before their teardown writes the report."""


def pytest_keyboard_interrupt(excinfo) -> None:
    """Ctrl-C or SIGTERM: mark running suites interrupted (their fixture teardown then undoes the
    fault in flight, stops every server and writes ``"status": "interrupted"``)."""
    for suite in _SUITES:
        suite.abort(excinfo.value)


@pytest.fixture
def chaos_case(request):
    """One ``(Scenario, target)`` of the catalog (parametrised by the plugin)."""
    return request.param


def selected_cases(session: pytest.Session) -> list:
    """``[(Scenario, target)]`` of the session's selected ``chaos_case`` tests, in run order: what
    ``-k``, ``-m`` and deselecting hooks left. The suite's pool warms up the pairs of these only (a
    pair started ahead for a deselected case would cost a start on 2 cores and run unused)."""
    cases = []
    for item in getattr(session, "items", []):
        case = getattr(item, "callspec", None) and item.callspec.params.get("chaos_case")
        if case and case not in cases:
            cases.append(case)
    return cases


@pytest.fixture(scope="session")
def leasekit_suite(request):
    """A session-wide chaos suite (one pool of pairs); finished (pairs stopped, reports written)
    at session end. Use ``leasekit_suite.run_one(scenario, target)``; for an external pair a
    scenario it cannot serve is skipped."""
    from leasekit.chaos.pool import ExternalPool
    from leasekit.chaos.suite import Suite

    config = request.config
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(config.getoption("--leasekit-run-dir") or Path("runs") / f"pytest-{stamp}")
    pool = None
    if _external(config):
        from leasekit.cluster.external import ExternalPair

        pair = ExternalPair(config.getoption("--leasekit-prefill-url"), config.getoption("--leasekit-decode-url"),
                            config.getoption("--leasekit-pair-dir"), target=config.getoption("--leasekit-pair-target"),
                            lease_duration_s=config.getoption("--leasekit-lease-duration") or 30,
                            prefill_log=config.getoption("--leasekit-prefill-log"))
        pool = ExternalPool(pair)
    from leasekit.chaos.suite import interrupts_as_keyboard_interrupt

    suite = Suite(selected_cases(request.session) or planned_cases(config), run_dir, pool=pool,
                  deployment=deployment(config))  # the plan lets the pool warm up what comes next
    suite.external = pool is not None
    _SUITES.append(suite)
    try:
        with interrupts_as_keyboard_interrupt():  # SIGTERM (a cancelled CI job) tears down like Ctrl-C
            yield suite
    finally:
        _SUITES.remove(suite)
        suite.finish()


@pytest.fixture(scope="session")
def leasekit_pair(leasekit_suite):
    """A started pair (LeaseKitConnector on P and D, L = 6 s, D with one running slot), shared by
    the session, or the external pair when URLs were given."""
    from leasekit.cluster.pair import PairSpec

    spec = PairSpec.pinned(lease_duration_s=6, fault_files=True, deployment=leasekit_suite.deployment)
    if getattr(leasekit_suite, "external", False):
        spec = leasekit_suite.pool.pair.spec
    return leasekit_suite.pool.get(spec)


def run_case(suite, scenario, target):
    """Run one catalog case on ``suite``; skip it (with the reason) when an external pair cannot
    serve it. Returns the :class:`leasekit.chaos.execute.ScenarioResult`."""
    if getattr(suite, "external", False):
        from leasekit.chaos.pool import pair_spec, unsupported_reason

        why = unsupported_reason(scenario) or suite.pool.pair.matches(pair_spec(scenario, target))
        if why:
            pytest.skip(f"{scenario.name}: {why}")
    return suite.run_one(scenario, target)
