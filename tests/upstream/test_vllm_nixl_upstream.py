"""vLLM's own NIXL connector unit tests (pull mode, vllm 0.32.0 sdist) pass with LeaseKit's connector,
worker and scheduler substituted for vLLM's as they do on stock, except the differences listed in
:data:`tests.upstream.run_vllm_nixl_tests.INTENDED_DIFFERENCES` (each with its reason).

Marked ``upstream`` and run only when a ``-m`` expression names that marker (``pytest -m upstream``);
a plain ``pytest`` skips it (minutes of run time, a download on first use). The first run
fetches the sdist, ray and tblib into ``$LEASEKIT_UPSTREAM_CACHE`` and runs the stock suite once (its
outcomes are cached); later runs only run the LeaseKit side. Skipped when the package index cannot be
reached. ``LEASEKIT_UPSTREAM_FILES`` (space-separated names from ``TEST_FILES``) runs a subset.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error

import pytest

from tests.upstream import run_vllm_nixl_tests as harness

MIN_STOCK_PASSED_SHARE = 0.8
"""Stock passes 646 of the 655 tests here; far fewer means the environment broke, not LeaseKit."""


def _files() -> tuple[str, ...]:
    names = tuple(os.environ.get("LEASEKIT_UPSTREAM_FILES", "").split()) or harness.TEST_FILES
    unknown = sorted(set(names) - set(harness.TEST_FILES))
    if unknown:
        raise ValueError(f"LEASEKIT_UPSTREAM_FILES: {unknown} not in TEST_FILES {harness.TEST_FILES}")
    return names


def _prepare():
    cache = harness.cache_dir()
    try:
        return cache, harness.extract_tests(cache), harness.install_deps(cache), harness.hf_home(cache)
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        pytest.skip(f"package index unreachable, cannot fetch {harness.SDIST}: {exc}")
    except subprocess.CalledProcessError as exc:
        if "connection" in (exc.stderr or "").lower() or "network" in (exc.stderr or "").lower():
            pytest.skip(f"package index unreachable, cannot install {harness.DEPS}: {exc.stderr[-500:]}")
        raise


@pytest.mark.upstream
@pytest.mark.timeout(harness.RUN_TIMEOUT_S * 2)
def test_vllm_nixl_unit_tests_pass_with_leasekit_as_on_stock(tmp_path, request):
    if "upstream" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("vLLM's upstream NIXL tests run only when selected: pytest -m upstream")
    files = _files()
    cache, root, deps, hf = _prepare()
    stock_file = cache / f"stock-{harness.stock_key(files)}.json"
    if stock_file.is_file():
        stock = json.loads(stock_file.read_text())
    else:
        stock = harness.run_upstream("stock", root, deps, hf, tmp_path, files).outcomes
        stock_file.write_text(json.dumps(stock, indent=0, sort_keys=True))
    assert harness.counts(stock).get("passed", 0) >= MIN_STOCK_PASSED_SHARE * len(stock), (
        f"stock vLLM passes only {harness.counts(stock)}: the upstream environment is broken")
    run = harness.run_upstream("leasekit", root, deps, hf, tmp_path, files)
    assert set(run.outcomes) == set(stock), "stock and LeaseKit runs collected different tests"
    found = harness.regressions(stock, run.outcomes)
    bad = harness.unexpected(found)
    assert not bad, (f"{len(bad)} upstream tests pass on stock vLLM and fail with LeaseKit "
                     f"(log: {tmp_path / 'leasekit.log'}):\n" + "\n".join(bad))
    selected = {t for t in harness.INTENDED_DIFFERENCES if t.split("::")[0].rsplit("/", 1)[-1] in files}
    stale = sorted(selected - set(found))
    assert not stale, "listed as intended differences but no longer differ (remove them):\n" + "\n".join(stale)
