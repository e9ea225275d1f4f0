"""vLLM's own NIXL connector unit tests (pull mode), run twice: on stock vLLM and with LeaseKit's
classes substituted for vLLM's; lists the tests that pass on stock and not on LeaseKit.

Source: ``tests/v1/kv_connector/unit/`` of the vllm 0.32.0 source distribution (the release
LeaseKit runs on), SHA-256 pinned; no upstream file and no assertion is changed. The substitution is
done by the pytest plugin :mod:`lk_upstream_plugin` (this directory): ``NixlConnector`` /
``NixlPullConnector`` -> ``LeaseKitConnector``, ``NixlConnectorWorker`` / ``NixlPullConnectorWorker``
-> ``LeaseKitPullWorker``, ``NixlConnectorScheduler`` / ``NixlPullConnectorScheduler`` ->
``LeaseKitPullScheduler`` (``leasekit.vllm.connector``), set on vLLM's modules before pytest imports
the test modules.

What the upstream tests need besides the project's environment, made here and cached under
``$LEASEKIT_UPSTREAM_CACHE`` (default ``~/.cache/leasekit/upstream``):

- the sdist (from the package index pip uses, through its JSON API as
  ``tests/unit/test_vllm_033_static.py`` fetches 0.33.0; ``pip download`` would run vLLM's
  ``setup.py``); only ``tests/`` and ``pyproject.toml`` (vLLM's pytest settings) are extracted;
- ``ray`` and ``tblib`` (:data:`DEPS`), installed with ``pip install --target`` into the cache, never
  into the project's environment, and put after site-packages on ``sys.path``;
- the Hugging Face config of ``facebook/opt-125m`` (``unit/utils.py``'s ``create_vllm_config``
  default model): written from ``transformers.OPTConfig``'s defaults, which are OPT-125m's, into an
  offline Hugging Face cache (``HF_HUB_OFFLINE=1``: nothing is fetched from the hub). Tests that need
  other models' configs or weights fail alike on stock and LeaseKit and are not compared.

Usage: ``python tests/upstream/run_vllm_nixl_tests.py [--out DIR] [--fresh-stock] [--files F ...]
[--only stock|leasekit]``; exit status 1
when a test passes on stock and not on LeaseKit and is not in :data:`INTENDED_DIFFERENCES`. The stock
outcomes are cached per (sdist, installed vLLM, test files, dependencies); ``--fresh-stock`` reruns them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RELEASE = "0.32.0"
SDIST = f"vllm-{RELEASE}.tar.gz"
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
"""SHA-256 of vllm-0.32.0.tar.gz on PyPI (44,549,956 bytes)."""
UNIT = "tests/v1/kv_connector/unit"
TEST_FILES = (
    # the files whose tests build vLLM's pull-mode NixlConnector, its worker or its scheduler: by name,
    # or through unit/utils.py's create_vllm_config / create_scheduler (default kv_connector="NixlConnector")
    "test_bidirectional_kv_transfer.py",
    "test_cache_pollution_prevention.py",
    "test_config.py",
    "test_error_propagation.py",
    "test_invalid_blocks_correctness.py",
    "test_kv_load_failure_recovery.py",
    "test_multi_connector.py",
    "test_nixl_connector.py",
    "test_nixl_connector_hma.py",
    "test_nixl_desc_geometry.py",
    "test_nixl_heartbeat.py",
    "test_nixl_rocm_gpu_mem_diag.py",
    "test_nixl_simple_cpu_offload.py",
    "test_remote_decode_lifecycle.py",
    "test_remote_prefill_lifecycle.py",
    "test_tp_mapping.py",
)
EXCLUDED_FILES = {
    "test_nixl_push_connector.py": "push mode (NixlPushConnector, WRITE transfers): LeaseKit wraps the pull connector only",
}
DEPS = ("ray==2.60.0", "tblib==3.2.2")
"""Imports of the upstream tests beyond the project's environment: ray (test_nixl_connector.py), tblib
(vLLM's tests/conftest.py)."""
HF_MODELS = {"facebook/opt-125m": "OPTConfig"}
"""Model id -> the transformers config class whose defaults are that model's config."""
RUN_TIMEOUT_S = 3600

INTENDED_DIFFERENCES: dict[str, str] = {
    # node id (relative to the sdist root) -> why LeaseKit intentionally differs from stock
    f"{UNIT}/test_nixl_connector.py::test_notification_after_expiry_is_counted": (
        "a completion for a request P never held is dropped and counted as unknown_id "
        "(leasekit_kv_lease_notifications_dropped_total{reason=\"unknown_id\"}), not as vLLM's notification after "
        "expiry: only a completion for a lease P granted and then ended is a late read; a stranger's claim "
        "(a bad or confused peer) must not inflate the late-read count that alerts act on"),
    f"{UNIT}/test_nixl_connector.py::test_kv_connector_stats": (
        "a fresh LeaseKit worker's stats are not empty: it reports its lease configuration (L, H, E and the "
        "max hold, leasekit_kv_lease_duration_seconds and friends) with its first stats report, so /metrics "
        "shows the configuration before the first lease"),
}
"""Tests that pass on stock and fail with LeaseKit by design, each with its reason; the project's docs
must list the same differences with the same reasons."""


@dataclass
class Run:
    """One upstream run: ``outcomes`` (node id -> passed/failed/skipped/xfailed/xpassed), wall seconds."""

    mode: str
    outcomes: dict[str, str]
    seconds: float
    returncode: int


def cache_dir() -> Path:
    """``$LEASEKIT_UPSTREAM_CACHE``, else ``~/.cache/leasekit/upstream``."""
    return Path(os.environ.get("LEASEKIT_UPSTREAM_CACHE") or Path.home() / ".cache" / "leasekit" / "upstream")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(cache: Path, timeout_s: float = 300) -> Path:
    """The pinned sdist in ``cache`` (downloaded when absent or different).

    Raises:
        OSError (urllib.error.URLError included): the package index cannot be reached.
        RuntimeError: the file's SHA-256 is not :data:`SDIST_SHA256`.
    """
    archive = cache / SDIST
    if archive.is_file() and _sha256(archive) == SDIST_SHA256:
        return archive
    cache.mkdir(parents=True, exist_ok=True)
    index = (os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple").rstrip("/")
    request = urllib.request.Request(f"{index}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        (entry,) = [f for f in json.load(answer)["files"] if f["filename"] == SDIST]
    partial = archive.with_suffix(".part")
    with urllib.request.urlopen(entry["url"], timeout=timeout_s) as answer, partial.open("wb") as out:
        for chunk in iter(lambda: answer.read(1 << 20), b""):
            out.write(chunk)
    if _sha256(partial) != SDIST_SHA256:
        raise RuntimeError(f"{entry['url']}: SHA-256 {_sha256(partial)}, expected {SDIST_SHA256}")
    partial.replace(archive)
    return archive


def extract_tests(cache: Path) -> Path:
    """The sdist's ``tests/`` and ``pyproject.toml`` under ``cache/vllm-<release>-<sha>`` (the root the
    runs start in; it holds no ``vllm/`` package, so the installed vLLM is the one tested)."""
    root = cache / f"vllm-{RELEASE}-{SDIST_SHA256[:12]}"
    stamp = root / ".extracted"
    if stamp.is_file():
        return root
    prefix = f"vllm-{RELEASE}/"
    with tarfile.open(fetch_sdist(cache), "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() and (
            m.name.startswith(prefix + "tests/") or m.name == prefix + "pyproject.toml")]
        for member in members:
            target = root / member.name[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
    stamp.write_text(SDIST_SHA256)
    return root


def install_deps(cache: Path) -> Path:
    """:data:`DEPS` installed with ``pip install --target`` into ``cache/deps-<hash>`` (once).

    Raises:
        subprocess.CalledProcessError: pip failed (its output is in the exception)."""
    target = cache / ("deps-" + hashlib.sha256(" ".join(DEPS).encode()).hexdigest()[:12])
    if (target / ".installed").is_file():
        return target
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "--target", str(target), *DEPS], check=True, capture_output=True, text=True)
    (target / ".installed").write_text("\n".join(DEPS))
    return target


def hf_home(cache: Path) -> Path:
    """An offline Hugging Face cache holding the config.json of each :data:`HF_MODELS` model."""
    import transformers

    home = cache / "hf-home"
    revision = "0" * 40
    for model, config_class in HF_MODELS.items():
        repo = home / "hub" / ("models--" + model.replace("/", "--"))
        snapshot = repo / "snapshots" / revision
        if not (snapshot / "config.json").is_file():
            config = getattr(transformers, config_class)(architectures=[config_class.replace("Config", "ForCausalLM")],
                                                          torch_dtype="float16")
            config.save_pretrained(snapshot)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return home


def run_upstream(mode: str, root: Path, deps: Path, hf: Path, out: Path, files: tuple[str, ...] = TEST_FILES,
                 extra_args: tuple[str, ...] = ()) -> Run:
    """Run the upstream test files in ``root`` once, ``mode`` "stock" or "leasekit"; junit xml, log and
    outcomes go to ``out/<mode>.{xml,log,json}``.

    Raises:
        ValueError: ``mode`` is neither; RuntimeError: pytest wrote no outcomes (it could not start)."""
    if mode not in ("stock", "leasekit"):
        raise ValueError(f"mode must be 'stock' or 'leasekit', not {mode!r}")
    out.mkdir(parents=True, exist_ok=True)
    outcomes_file = out / f"{mode}.json"
    outcomes_file.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
               LEASEKIT_UPSTREAM_DEPS=str(deps), LEASEKIT_UPSTREAM_OUTCOMES=str(outcomes_file),
               LEASEKIT_UPSTREAM_SUBSTITUTE="1" if mode == "leasekit" else "0",
               LEASEKIT_RUN_DIR=str(out / f"{mode}-leasekit-run"), HF_HOME=str(hf), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "pytest", *(f"{UNIT}/{f}" for f in files), "-p", "lk_upstream_plugin",
           "-p", "no:leasekit", "-p", "no:cacheprovider", "-q", "-rfE", "--durations=20",
           f"--junitxml={out / f'{mode}.xml'}", *extra_args]
    started = time.monotonic()
    with (out / f"{mode}.log").open("w") as log:
        proc = subprocess.run(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    seconds = time.monotonic() - started
    if not outcomes_file.is_file():
        raise RuntimeError(f"{mode} run wrote no outcomes (exit {proc.returncode}); see {out / f'{mode}.log'}")
    return Run(mode, json.loads(outcomes_file.read_text()), seconds, proc.returncode)


def stock_key(files: tuple[str, ...] = TEST_FILES) -> str:
    """What the stock outcomes depend on: the sdist, the installed vLLM and torch, the files, the deps."""
    import torch
    import vllm

    text = json.dumps([SDIST_SHA256, vllm.__version__, torch.__version__, files, DEPS, HF_MODELS])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def regressions(stock: dict[str, str], leasekit: dict[str, str]) -> list[str]:
    """Node ids that passed on stock and did not pass with LeaseKit (missing counts as not passed)."""
    return sorted(t for t, o in stock.items() if o == "passed" and leasekit.get(t) != "passed")


def unexpected(found: list[str], intended: dict[str, str] = INTENDED_DIFFERENCES) -> list[str]:
    """The regressions not listed in ``intended``."""
    return [t for t in found if t not in intended]


def counts(outcomes: dict[str, str]) -> dict[str, int]:
    """Outcome -> number of tests."""
    result: dict[str, int] = {}
    for outcome in outcomes.values():
        result[outcome] = result.get(outcome, 0) + 1
    return dict(sorted(result.items()))


def main(argv: list[str] | None = None) -> int:
    """CLI: run (or reuse) stock, run LeaseKit, print the comparison; 1 on an unexpected regression."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="where junit xml, logs and outcomes go")
    parser.add_argument("--fresh-stock", action="store_true", help="rerun stock even if cached")
    parser.add_argument("--only", choices=("stock", "leasekit"), help="run one mode only (no comparison)")
    parser.add_argument("--files", nargs="+", choices=TEST_FILES, default=list(TEST_FILES), metavar="FILE",
                        help=f"a subset of the upstream files (default: all {len(TEST_FILES)})")
    args = parser.parse_args(argv)
    files = tuple(args.files)
    cache = cache_dir()
    root, deps, hf = extract_tests(cache), install_deps(cache), hf_home(cache)
    out = args.out or cache / "runs" / time.strftime("%Y%m%d-%H%M%S")
    if args.only:
        run = run_upstream(args.only, root, deps, hf, out, files)
        print(f"{run.mode}: {counts(run.outcomes)} in {run.seconds:.0f} s -> {out}")
        return 0
    stock_file = cache / f"stock-{stock_key(files)}.json"
    if stock_file.is_file() and not args.fresh_stock:
        stock = json.loads(stock_file.read_text())
        print(f"stock: {counts(stock)} (cached {stock_file})")
    else:
        run = run_upstream("stock", root, deps, hf, out, files)
        stock = run.outcomes
        stock_file.write_text(json.dumps(stock, indent=0, sort_keys=True))
        print(f"stock: {counts(stock)} in {run.seconds:.0f} s")
    run = run_upstream("leasekit", root, deps, hf, out, files)
    print(f"leasekit: {counts(run.outcomes)} in {run.seconds:.0f} s")
    found = regressions(stock, run.outcomes)
    for test in found:
        print(f"{'intended' if test in INTENDED_DIFFERENCES else 'REGRESSION'}: {test} ({run.outcomes.get(test, 'missing')})")
    bad = unexpected(found)
    print(f"{len(found)} pass on stock and not on LeaseKit, {len(bad)} not intended; junit xml and logs in {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
