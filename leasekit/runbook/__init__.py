"""Runbook commands of the ``leasekit`` CLI, one module each, each with ``register(subparsers)``:

- :mod:`leasekit.runbook.status`: ``leasekit status URL...`` (lease health from ``/metrics``);
- :mod:`leasekit.runbook.explain`: ``leasekit explain REQUEST_ID`` (one lease's timeline from spans);
- :mod:`leasekit.runbook.lint`: ``leasekit lint --kv-transfer-config JSON``.

Helpers: :mod:`~leasekit.runbook.promscrape` and :mod:`~leasekit.runbook.health` (status),
:mod:`~leasekit.runbook.spansearch` and :mod:`~leasekit.runbook.timeline` (explain),
:mod:`~leasekit.runbook.common` (exit codes, formatting).
"""

from __future__ import annotations

import argparse


def register_all(subparsers: argparse._SubParsersAction) -> None:
    """Add ``status``, ``explain`` and ``lint`` to ``subparsers`` (``ArgumentParser.add_subparsers``)."""
    from leasekit.runbook import explain, lint, status

    for module in (status, explain, lint):
        module.register(subparsers)
