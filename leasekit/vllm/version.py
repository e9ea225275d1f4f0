"""Version guard: LeaseKitConnector hooks private methods and reads private attributes of vLLM's
NixlConnector, so it only loads on the releases it was checked against, and checks at import that
the installed vLLM still has each hook with the recorded signature and each attribute.

What LeaseKit needs of vLLM is recorded per release in :mod:`leasekit.vllm.needs` (re-exported here:
:data:`RELEASE_NEEDS`): for each vLLM class, the methods it overrides or calls with their parameter
names (as :func:`inspect.signature` gives them), the instance attributes it reads, the methods vLLM
must call with keywords only, words a method body must contain; the ``kv_transfer_params`` keys of
vLLM's that LeaseKit reads or writes; the wire literals of the NIXL notifications and the handshake
(``"HB:"``, ``","``, ``"{}:{}"``, ``b"get_meta_msg"``, ...); the names LeaseKit adds to vLLM's objects;
and the log formats the stock-log parser reads (:mod:`leasekit.telemetry.vllm_log`). At import
(:func:`check_installed`) signatures are read with :mod:`inspect` and the rest (all but the log
formats) from the installed ``.py`` files with :mod:`ast` (:mod:`leasekit.vllm.vllmsrc`: attributes
exist only after ``__init__``). The same records are checked statically against a release's source
distribution (:func:`check_source`; tests/unit/test_vllm_033_static.py for 0.33.0, which is CUDA only
and cannot be imported here).

No vLLM import at module level (``leasekit.vllm`` must import without vLLM).
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

from leasekit.lease.releases import INSTALL_COMMANDS, SUPPORTED_VLLM_RELEASES, release_of
from leasekit.vllm.needs import LEASEKIT_PREFIXES, NIXL, RELEASE_NEEDS, ClassNeeds, ReleaseNeeds, WireNeeds
from leasekit.vllm.vllmsrc import SourceIndex, index_modules, param_names, read_modules

__all__ = ["ALLOW_UNSUPPORTED_ENV", "ClassNeeds", "NIXL", "RELEASE_NEEDS", "ReleaseNeeds", "SUPPORTED_VLLM_RELEASES",
           "UnsupportedVllmError", "WireNeeds", "check_hooks", "check_installed", "check_source",
           "check_vllm_release", "needs_for", "signature_problems"]

ALLOW_UNSUPPORTED_ENV = "LEASEKIT_ALLOW_UNSUPPORTED_VLLM"


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not a release LeaseKitConnector supports, or lacks a hook, signature or
    attribute it needs; the message names them and the fix."""


def _supported_text() -> str:
    return ", ".join(SUPPORTED_VLLM_RELEASES)


def check_vllm_release(version: str, *, allow_unsupported: bool | None = None) -> None:
    """Refuse an unsupported vLLM release.

    Args:
        version: ``vllm.__version__`` (a local part such as ``+cpu`` is ignored).
        allow_unsupported: skip the check; defaults to env ``LEASEKIT_ALLOW_UNSUPPORTED_VLLM=1``
            (at your own risk: private hooks may have changed meaning; :func:`check_installed` then
            checks against the newest supported release's records).

    Raises:
        UnsupportedVllmError: ``version`` is not in :data:`SUPPORTED_VLLM_RELEASES`.
    """
    if allow_unsupported is None:
        allow_unsupported = os.environ.get(ALLOW_UNSUPPORTED_ENV, "") == "1"
    if allow_unsupported or release_of(version) in SUPPORTED_VLLM_RELEASES:
        return
    installs = "; ".join(f"{r}: {INSTALL_COMMANDS[r]}" for r in SUPPORTED_VLLM_RELEASES)
    raise UnsupportedVllmError(
        f"LeaseKitConnector does not support vLLM {version}; supported releases: {_supported_text()}. "
        f"Fix: install one of them ({installs}), or use the stock NixlConnector. "
        f"{ALLOW_UNSUPPORTED_ENV}=1 skips this check at your own risk."
    )


def needs_for(version: str) -> ReleaseNeeds:
    """The records of ``version``'s release; the newest supported release's for any other version
    (what :func:`check_installed` holds an allowed unsupported release to)."""
    return RELEASE_NEEDS.get(release_of(version), RELEASE_NEEDS[SUPPORTED_VLLM_RELEASES[-1]])


def check_hooks(cls: type, names: tuple[str, ...]) -> None:
    """Check that ``cls`` still has every method in ``names`` (callable attributes).

    Raises:
        UnsupportedVllmError: a hook is missing (vLLM internals changed); the message names it.
    """
    missing = [name for name in names if not callable(getattr(cls, name, None))]
    if missing:
        raise UnsupportedVllmError(
            f"vLLM's {cls.__name__} lacks {', '.join(missing)}: its internals changed. "
            f"Supported vLLM releases: {_supported_text()}."
        )


def signature_problems(cls: type, needs: ClassNeeds) -> list[str]:
    """Each method of ``needs`` that ``cls`` lacks or whose parameter names differ, as
    ``"Class.method: ..."`` (read with :func:`inspect.signature`); empty when all match."""
    problems = []
    for name, expected in needs.methods.items():
        method = getattr(cls, name, None)
        if not callable(method):
            problems.append(f"{needs.name}.{name}: missing")
            continue
        try:
            found = param_names(method)
        except (TypeError, ValueError) as exc:
            problems.append(f"{needs.name}.{name}: no signature ({exc})")
            continue
        if found != tuple(expected):
            problems.append(f"{needs.name}.{name}: parameters ({', '.join(found)}), expected ({', '.join(expected)})")
    return problems


def check_source(index: SourceIndex, needs: ReleaseNeeds, *, methods: bool = True, logs: bool = False) -> list[str]:
    """Check ``needs`` against vLLM source read with :func:`leasekit.vllm.vllmsrc.index_modules`.

    Args:
        index: the indexed modules (at least ``needs.source_modules``; with ``logs`` also the modules
            of ``needs.log_formats``).
        methods: check method presence and parameter names (by :mod:`ast`); the import-time guard
            checks them with :mod:`inspect` instead and passes False.
        logs: check the log formats too.

    Returns:
        One ``"Class.member: ..."`` (or ``"module: ..."``, ``"wire name: ..."``, ``"kv_transfer_params
        key: ..."``) line per problem; empty when all is there. Checked: each class's methods,
        attributes, keyword-only calls and writes; each wire literal and ``kv_transfer_params`` key at
        its sites; that no indexed vLLM class uses a name of ``needs.leasekit_keys`` or one with a prefix
        of :data:`~leasekit.vllm.needs.LEASEKIT_PREFIXES`; with ``logs``, the log formats.
    """
    problems: list[str] = []
    for cls in needs.classes:
        try:
            have = index.attributes(cls.name, cls.module)
        except KeyError as exc:
            problems.append(f"{cls.name}: not found in {cls.module} ({exc.args[0]})")
            continue
        if methods:
            for name, expected in cls.methods.items():
                found = index.method(cls.name, name, cls.module)
                if found is None:
                    problems.append(f"{cls.name}.{name}: missing")
                elif found[1] != tuple(expected):
                    problems.append(f"{cls.name}.{name} (on {found[0]}): parameters ({', '.join(found[1])}), "
                                    f"expected ({', '.join(expected)})")
        problems += [f"{cls.name}.{a}: attribute never set" for a in cls.attributes if a not in have]
        own = index.mro(cls.name, cls.module)
        for name in cls.keyword_calls:
            if not any(name in c.self_calls for c in own):
                problems.append(f"{cls.name}: never calls self.{name}(...) (expected keyword-only calls)")
            elif any(name in c.positional_calls for c in own):
                problems.append(f"{cls.name}: calls self.{name}(...) with positional arguments (LeaseKit reads "
                                "them by keyword)")
        for method, words in cls.writes.items():
            body = next((c.method_words[method] for c in own if method in c.method_words), frozenset())
            problems += [f"{cls.name}.{method}: no longer writes {w!r}" for w in words if w not in body]
    for name, wire in needs.wire.items():
        problems += [f"wire {name} ({wire.value!r}): {p}" for p in _wire_problems(index, wire)]
    for key, sites in needs.kv_params.items():
        for site in sites:
            words = _site_body(index, site, words=True)
            if isinstance(words, str) or key not in words:
                problems.append(f"kv_transfer_params key {key!r}: {words if isinstance(words, str) else 'unused'} "
                                f"in {site}")
    problems += _leasekit_name_problems(index, needs.leasekit_keys)
    if logs:
        for module, formats in needs.log_formats.items():
            have_logs = index.log_formats.get(module)
            if have_logs is None:
                problems.append(f"{module}: not indexed (log formats unchecked)")
                continue
            problems += [f"{module}: no log call with format {f!r}" for f in formats if f not in have_logs]
    return problems


def _site_body(index: SourceIndex, site: str, *, words: bool) -> frozenset[str] | str:
    """The literal forms (or, with ``words``, the method words) of site ``"module:Class.method"``,
    found on the class or an indexed base; a problem text when the class or method is not there."""
    module, _, qualname = site.rpartition(":")
    cls, _, method = qualname.partition(".")
    try:
        chain = index.mro(cls, module)
    except KeyError as exc:
        return f"class not indexed ({exc.args[0]})"
    for c in chain:
        if method in c.methods:
            return (c.method_words if words else c.method_literals).get(method, frozenset())
    return "method missing"


def _wire_problems(index: SourceIndex, wire: WireNeeds) -> list[str]:
    problems = []
    for site, forms in wire.sites.items():
        module, _, qualname = site.rpartition(":")
        if "." not in qualname:  # a module-level constant
            found = index.constants.get(module, {}).get(qualname, "<absent>")
            if found != wire.value:
                problems.append(f"{site} is {found!r}, expected {wire.value!r}")
            continue
        body = _site_body(index, site, words=False)
        if isinstance(body, str):
            problems.append(f"{site}: {body}")
        else:
            problems += [f"{site} no longer contains {f}" for f in forms if f not in body]
    return problems


def _leasekit_name_problems(index: SourceIndex, keys: tuple[str, ...]) -> list[str]:
    """vLLM classes that use one of LeaseKit's names (``keys``, or a :data:`LEASEKIT_PREFIXES` prefix)."""
    problems = []
    for defs in index.classes.values():
        for c in defs:
            used = set(c.attributes) | set(c.methods)
            for words in c.method_words.values():
                used |= words
            clash = sorted(n for n in used if n in keys or n.startswith(LEASEKIT_PREFIXES))
            problems += [f"{c.name} ({c.module}) uses LeaseKit's name {n!r}" for n in clash]
    return problems


def check_installed(version: str, *, source_root: Path | None = None) -> None:
    """The import-time guard: the installed vLLM has every hook with its recorded signature
    (:mod:`inspect`) and every attribute, keyword-only call, write, wire literal and
    ``kv_transfer_params`` key, and uses none of LeaseKit's names (:mod:`ast` over its ``.py`` files),
    that :func:`needs_for` ``(version)`` records.

    Args:
        version: ``vllm.__version__``.
        source_root: the directory holding the ``vllm`` package; defaults to the imported one's.

    Raises:
        UnsupportedVllmError: anything missing or different (every problem listed, with the fix);
            also when vLLM's source files cannot be read or parsed.
    """
    needs = needs_for(version)
    problems: list[str] = []
    for cls in needs.classes:
        obj = getattr(importlib.import_module(cls.module), cls.name, None)
        if not isinstance(obj, type):
            problems.append(f"{cls.module}.{cls.name}: missing")
            continue
        problems += signature_problems(obj, cls)
    if source_root is None:
        source_root = Path(importlib.import_module("vllm").__file__).resolve().parent.parent
    try:
        problems += check_source(index_modules(read_modules(source_root, needs.source_modules)), needs, methods=False)
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        problems.append(f"cannot read vLLM's source to check attributes: {exc}")
    if problems:
        raise UnsupportedVllmError(
            f"vLLM {version} differs from what LeaseKitConnector was checked against (vLLM {needs.release}): "
            + "; ".join(problems)
            + f". Fix: install a supported release ({_supported_text()}) from its official package, or use "
              "the stock NixlConnector."
        )
