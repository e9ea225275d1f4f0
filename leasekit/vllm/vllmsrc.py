"""Reading vLLM's source without importing it: classes, method signatures, instance attributes,
log formats, literals (wire bytes) and module constants.

LeaseKitConnector overrides private methods of vLLM's NixlConnector and reads its private
attributes (:mod:`leasekit.vllm.needs` lists them per release). Instance attributes only exist
after ``__init__`` runs, and a release built for CUDA cannot be imported on a CPU machine, so both
the import-time guard (on the installed vLLM's ``.py`` files) and the static test of a release's
source distribution read the code with :mod:`ast` instead.

Conventions (so that the two readers agree with :func:`inspect.signature`):

- a method's parameters are named as ``inspect.signature(getattr(cls, name))`` names them: ``self``
  included for a plain method, ``cls`` left out of a ``classmethod``, none added for a
  ``staticmethod``; ``*args`` and ``**kwargs`` keep their stars (:func:`param_names`);
- an attribute is any ``self.<name> = ...`` (also annotated, augmented or tuple targets) in any
  method of the class, a class-level assignment or annotation (dataclass fields), or a property;
- a method's literals (:func:`literal_forms`) are written as Python source writes them: a constant
  as its ``repr`` (``'HB:'``, ``b'get_meta_msg'``, ``1``), an f-string as ``f'...'`` with ``{}`` for
  each field (``f'{}:{}'``), a call with only constant arguments as ``.name(args)``
  (``.rsplit(':', 1)``, ``.encode()``), a method of a string constant as ``','.join``, a slice
  with constant bounds as ``[3:]``.

No vLLM import here; pure functions over source text.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

LOG_METHODS = frozenset({"debug", "info", "warning", "error", "exception", "critical",
                         "debug_once", "info_once", "warning_once"})
"""Logger methods whose first argument is read as a log format (vLLM's logger adds the ``_once`` ones)."""


@dataclass(frozen=True)
class ClassSource:
    """One class as written in a module.

    Attributes:
        name: the class name; module: its dotted module name.
        bases: the simple names of its base classes (``a.B`` -> ``B``).
        methods: method name -> parameter names (see the module docstring).
        attributes: instance and class attribute names (see the module docstring).
        positional_calls: names of ``self.<name>(...)`` calls that pass at least one positional argument.
        self_calls: names of every ``self.<name>(...)`` call.
        method_words: method name -> every string constant, call keyword name and attribute name in its
            body (keys it writes with ``dict(key=...)`` or ``{"key": ...}``, the attributes it uses).
        method_literals: method name -> the :func:`literal_forms` of its body (what the notification
            bytes it sends or parses are made of).
    """

    name: str
    module: str
    bases: tuple[str, ...]
    methods: Mapping[str, tuple[str, ...]]
    attributes: frozenset[str]
    positional_calls: frozenset[str]
    self_calls: frozenset[str]
    method_words: Mapping[str, frozenset[str]]
    method_literals: Mapping[str, frozenset[str]] = field(default_factory=dict)


@dataclass
class SourceIndex:
    """The classes and log formats of a set of modules (:func:`index_modules`).

    Attributes:
        classes: class name -> every definition of that name (one per module that defines it).
        log_formats: dotted module name -> first arguments (string constants) of its logger calls.
        constants: dotted module name -> {name: value} of its module-level assignments of a literal
            (``GET_META_MSG = b"get_meta_msg"``; :func:`ast.literal_eval`).
    """

    classes: dict[str, list[ClassSource]] = field(default_factory=dict)
    log_formats: dict[str, frozenset[str]] = field(default_factory=dict)
    constants: dict[str, dict[str, object]] = field(default_factory=dict)

    def get(self, name: str, module: str | None = None) -> ClassSource:
        """The class ``name`` (defined in ``module`` when given, else the only definition).

        Raises:
            KeyError: no such class, or several and ``module`` not given.
        """
        found = [c for c in self.classes.get(name, ()) if module is None or c.module == module]
        if len(found) != 1:
            where = f" in {module}" if module else ""
            raise KeyError(f"class {name}{where}: {len(found)} definitions in the indexed vLLM source")
        return found[0]

    def mro(self, name: str, module: str | None = None) -> list[ClassSource]:
        """``name`` then its indexed bases, depth first, each once; bases not indexed are skipped.

        Raises:
            KeyError: ``name`` itself is not indexed (see :meth:`get`).
        """
        order: list[ClassSource] = []
        stack = [self.get(name, module)]
        while stack:
            cls = stack.pop(0)
            if cls in order:
                continue
            order.append(cls)
            stack[:0] = [self.get(b) for b in cls.bases if len(self.classes.get(b, ())) == 1]
        return order

    def method(self, cls: str, name: str, module: str | None = None) -> tuple[str, tuple[str, ...]] | None:
        """``(defining class, parameter names)`` of ``cls.name`` through the indexed bases, or None."""
        for c in self.mro(cls, module):
            if name in c.methods:
                return c.name, c.methods[name]
        return None

    def literals(self, cls: str, name: str, module: str | None = None) -> tuple[str, frozenset[str]] | None:
        """``(defining class, literal forms)`` of method ``cls.name`` through the indexed bases, or None."""
        for c in self.mro(cls, module):
            if name in c.methods:
                return c.name, c.method_literals.get(name, frozenset())
        return None

    def attributes(self, cls: str, module: str | None = None) -> frozenset[str]:
        """Every attribute and method name of ``cls`` and its indexed bases."""
        names: set[str] = set()
        for c in self.mro(cls, module):
            names |= c.attributes | set(c.methods)
        return frozenset(names)


def param_names(obj: object) -> tuple[str, ...]:
    """Parameter names of a callable as :func:`inspect.signature` gives them, ``*``/``**`` kept.

    Raises:
        TypeError, ValueError: ``obj`` has no signature (not callable, or a builtin without one).
    """
    out = []
    for p in inspect.signature(obj).parameters.values():
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        out.append(prefix + p.name)
    return tuple(out)


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return names


def _def_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    if "classmethod" in _decorators(fn) and names:
        names = names[1:]
    return tuple(names)


def _self_targets(node: ast.AST) -> Iterable[str]:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        yield node.attr
    elif isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _self_targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _self_targets(node.value)


def _constant_form(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes, int)) and not isinstance(
            node.value, bool):
        return repr(node.value)
    return None


def literal_forms(tree: ast.AST) -> frozenset[str]:
    """The literals of ``tree`` as source writes them (see the module docstring): constants, f-string
    templates, calls with constant arguments, string-constant methods and constant slices.

    (``msg.rsplit(":", 1)`` gives ``"':'"``, ``'1'`` and ``".rsplit(':', 1)"``.)
    """
    forms: set[str] = set()
    for node in ast.walk(tree):
        const = _constant_form(node)
        if const is not None:
            forms.add(const)
        elif isinstance(node, ast.JoinedStr):
            template = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            forms.add("f" + repr(template))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.keywords:
            args = [_constant_form(a) for a in node.args]
            if all(a is not None for a in args):
                forms.add(f".{node.func.attr}({', '.join(args)})")
        elif isinstance(node, ast.Attribute) and _constant_form(node.value) is not None:
            forms.add(f"{_constant_form(node.value)}.{node.attr}")
        elif isinstance(node, ast.Slice) and node.step is None:
            bounds = [("" if b is None else _constant_form(b)) for b in (node.lower, node.upper)]
            if all(b is not None for b in bounds):
                forms.add(f"[{bounds[0]}:{bounds[1]}]")
    return frozenset(forms)


def _class_source(node: ast.ClassDef, module: str) -> ClassSource:
    methods: dict[str, tuple[str, ...]] = {}
    attributes: set[str] = set()
    positional: set[str] = set()
    calls: set[str] = set()
    words: dict[str, frozenset[str]] = {}
    literals: dict[str, frozenset[str]] = {}
    for item in node.body:
        if isinstance(item, (ast.Assign, ast.AnnAssign)):
            for target in (item.targets if isinstance(item, ast.Assign) else [item.target]):
                if isinstance(target, ast.Name):
                    attributes.add(target.id)
        if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if _decorators(item) & {"property", "cached_property"}:
            attributes.add(item.name)
        else:
            methods[item.name] = _def_params(item)
        found: set[str] = set()
        for sub in ast.walk(item):
            if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in (sub.targets if isinstance(sub, ast.Assign) else [sub.target]):
                    attributes.update(_self_targets(target))
            elif isinstance(sub, ast.Call):
                found.update(k.arg for k in sub.keywords if k.arg)
                f = sub.func
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
                    calls.add(f.attr)
                    if sub.args:
                        positional.add(f.attr)
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                found.add(sub.value)
            if isinstance(sub, ast.Attribute):
                found.add(sub.attr)  # self._reqs_to_send, self.xfer_stats.record_kv_expired_req, ...
        words[item.name] = frozenset(found)
        literals[item.name] = literal_forms(item)
    bases = tuple(b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases)
    return ClassSource(node.name, module, tuple(b for b in bases if b), methods, frozenset(attributes),
                       frozenset(positional), frozenset(calls), words, literals)


def _log_formats(tree: ast.AST) -> frozenset[str]:
    formats = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOG_METHODS
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            formats.add(node.args[0].value)
    return frozenset(formats)


def _module_constants(tree: ast.Module) -> dict[str, object]:
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            out.update((t.id, value) for t in node.targets)
    return out


def index_modules(sources: Mapping[str, str]) -> SourceIndex:
    """Index the top-level classes, log formats and literal constants of ``{dotted module name: source text}``.

    Raises:
        SyntaxError: a source does not parse (names the module).
    """
    index = SourceIndex()
    for module, text in sources.items():
        try:
            tree = ast.parse(text, filename=module)
        except SyntaxError as exc:
            raise SyntaxError(f"{module}: {exc}") from exc
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                index.classes.setdefault(node.name, []).append(_class_source(node, module))
        index.log_formats[module] = _log_formats(tree)
        index.constants[module] = _module_constants(tree)
    return index


def module_path(root: Path, module: str) -> Path:
    """The ``.py`` file of dotted ``module`` under ``root`` (the directory that holds ``vllm/``)."""
    return root.joinpath(*module.split(".")).with_suffix(".py")


def read_modules(root: Path, modules: Iterable[str]) -> dict[str, str]:
    """``{module: source text}`` for each dotted module under ``root`` (:func:`module_path`).

    Raises:
        FileNotFoundError: a module has no ``.py`` file there (the message names it).
    """
    out = {}
    for module in modules:
        path = module_path(root, module)
        if not path.is_file():
            raise FileNotFoundError(f"vLLM source of {module} not found at {path}")
        out[module] = path.read_text(encoding="utf-8")
    return out


def module_constant(text: str, name: str) -> object:
    """The literal value of a module-level ``name = ...`` (or ``name: T = ...``) in source ``text``.

    Raises:
        KeyError: no such assignment; ValueError: its value is not a literal (:func:`ast.literal_eval`).
    """
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        else:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            parts = target.elts if isinstance(target, ast.Tuple) else [target]
            names = [t.id for t in parts if isinstance(t, ast.Name)]
            if name in names and node.value is not None:
                value = ast.literal_eval(node.value)
                if isinstance(target, ast.Tuple):  # a = b = 1 handled above; (a, b) = (1, 2) here
                    return value[names.index(name)]
                return value
    raise KeyError(f"no module-level assignment of {name}")
