"""The layers of leasekit, lowest first: a module imports only from its own package or a lower layer.

0. ``leasekit`` (the package itself) and ``leasekit.layers``: the version; this table.
1. ``leasekit.lease``: the lease protocol, pure: timing, bounds, table, codecs (no I/O, no vLLM, no
   processes).
2. ``leasekit.telemetry``: span, metric and log names; writing and reading lease evidence (spans,
   vLLM's own log lines).
3. ``leasekit.vllm`` and ``leasekit.sim``: what produces lease events: LeaseKitConnector inside vLLM,
   and the virtual-time model.
4. ``leasekit.cluster``: processes and hosts: vLLM servers, P/D pairs, router, testbeds, SSH hosts,
   launch-time clock shifts.
5. ``leasekit.chaos``: scenarios, fault injectors, checks, the suite.
6. ``leasekit.runbook`` and ``leasekit.dashboards``: operator tools over telemetry.
7. ``leasekit.cli``: the ``leasekit`` command.

Packages that share a layer are independent: neither imports the other. Inside one package modules
import each other freely, as long as no two modules import each other (directly or round a loop).
A module-level, function-level or ``TYPE_CHECKING`` import all count: each is a dependency.
``tests/unit/test_layers.py`` checks every module under ``leasekit/`` against :data:`LAYERS`.
When code of a higher layer is needed below, move it down (the data both need goes to the lower
package) rather than importing upward.
"""

from __future__ import annotations

LAYERS: tuple[tuple[str, ...], ...] = (
    ("leasekit", "leasekit.layers"),
    ("leasekit.lease",),
    ("leasekit.telemetry",),
    ("leasekit.vllm", "leasekit.sim"),
    ("leasekit.cluster",),
    ("leasekit.chaos",),
    ("leasekit.runbook", "leasekit.dashboards"),
    ("leasekit.cli",),
)
"""Layer ``i`` holds the packages (or root modules) of ``LAYERS[i]``; lowest first."""

ROOT = "leasekit"
"""The top package: listed on its own it means ``leasekit/__init__.py`` only, never its subpackages."""


def unit_of(module: str) -> str | None:
    """The entry of :data:`LAYERS` that ``module`` (a dotted name such as ``leasekit.chaos.faults.kill``)
    belongs to: the longest listed name equal to it or a package above it (``leasekit`` itself
    matches only the root package); None for a module outside ``leasekit`` or one no layer lists."""
    best: str | None = None
    for names in LAYERS:
        for name in names:
            exact = module == name
            inside = name != ROOT and module.startswith(name + ".")
            if (exact or inside) and (best is None or len(name) > len(best)):
                best = name
    return best


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` (0 = lowest) of ``module``'s layer; None as in :func:`unit_of`."""
    unit = unit_of(module)
    if unit is None:
        return None
    return next(i for i, names in enumerate(LAYERS) if unit in names)


def allowed(importer: str, imported: str) -> bool:
    """Whether module ``importer`` may import module ``imported`` (both dotted ``leasekit`` names):
    same package, or ``imported`` in a strictly lower layer.

    Raises:
        ValueError: either module is in no layer (add its package to :data:`LAYERS`).
    """
    units = unit_of(importer), unit_of(imported)
    for module, unit in zip((importer, imported), units):
        if unit is None:
            raise ValueError(f"module {module!r} is in no layer: add its package to leasekit.layers.LAYERS")
    if units[0] == units[1]:
        return True
    return layer_of(imported) < layer_of(importer)
