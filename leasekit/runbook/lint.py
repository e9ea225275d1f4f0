"""``leasekit lint --kv-transfer-config JSON``: check a ``--kv-transfer-config`` before starting vLLM;
``leasekit lint --prefill-vllm V --decode-vllm V``: check the vLLM versions of a P/D pair.

Runs :func:`leasekit.lease.config.lint_kv_transfer_config` (every rule and its source is documented
there) and, when the lease settings parse, prints the derived ``L``, ``H = L // 6``, ``E = L * 2 // 3``
with the safe stall and heartbeat loss budget of :mod:`leasekit.lease.bounds`. With the two vLLM
versions (what ``python -c "import vllm; print(vllm.__version__)"`` prints on P's and D's host) it
adds :func:`leasekit.lease.releases.pair_release_problems` as error findings: a release LeaseKit does
not support, or a mixed pair (vLLM refuses the handshake between 0.32.0 and 0.33.0). Either input, or
both, may be given.

Exit codes: 0 no error-severity finding (warnings allowed); 1 at least one error; 2 bad usage
(e.g. an ``@path`` that cannot be read).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from leasekit.lease.bounds import loss_budget, safe_stall_s
from leasekit.lease.config import LeaseConfig, LeaseConfigError, lint_kv_transfer_config
from leasekit.lease.releases import pair_release_problems
from leasekit.runbook.common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, console, error, fmt_num, print_json


def read_config_argument(text: str) -> str:
    """The config JSON text: ``text`` itself, or the contents of the file when given as ``@path``.

    Raises:
        OSError: the ``@path`` file cannot be read (UnicodeDecodeError, a ValueError, for non-UTF-8).
    """
    if text.startswith("@"):
        return Path(text[1:]).read_text(encoding="utf-8")
    return text


def lint_report(config: str | None, prefill_vllm: str | None = None, decode_vllm: str | None = None) -> dict[str, Any]:
    """Lint one config JSON string and/or the vLLM versions of a P/D pair.

    Args:
        config: the ``--kv-transfer-config`` JSON, or None to lint only the versions.
        prefill_vllm, decode_vllm: ``vllm.__version__`` on P's and D's host, or both None to skip;
            each problem is an error finding on field ``prefill_vllm``, ``decode_vllm`` or
            ``prefill_vllm/decode_vllm`` (a mixed pair).

    Returns:
        ``{"ok": bool, "errors": n, "warnings": n, "findings": [{field, severity, message, fix}],
        "timing": {lease_duration_s, heartbeat_interval_s, extension_s, decoder_kv_blocks_ttl_s,
        safe_stall_s, heartbeat_loss_budget} | None}``; ``ok`` is False iff there is an
        error-severity finding; ``timing`` is None when the lease settings do not parse
        (``heartbeat_loss_budget`` is None when undefined, see :func:`leasekit.lease.bounds.loss_budget`).
    """
    findings = [{"field": f.field, "severity": f.severity, "message": f.message, "fix": f.fix}
                for f in (lint_kv_transfer_config(config) if config is not None else ())]
    if prefill_vllm is not None or decode_vllm is not None:
        for field, problem, fix in pair_release_problems(prefill_vllm, decode_vllm):
            field = field.replace("_version", "_vllm")
            findings.append({"field": field, "severity": "error", "message": problem, "fix": fix})
    timing: dict[str, Any] | None = None
    cfg = None
    if config is not None:
        try:
            cfg = LeaseConfig.from_kv_transfer_config(config)
        except LeaseConfigError:
            cfg = None
    if cfg is not None:
        t = cfg.timing
        try:
            budget: int | None = loss_budget(t)
        except LeaseConfigError:
            budget = None
        timing = {"lease_duration_s": t.lease_duration_s, "heartbeat_interval_s": t.heartbeat_interval_s,
                  "extension_s": t.extension_s, "decoder_kv_blocks_ttl_s": cfg.decoder_kv_blocks_ttl_s,
                  "safe_stall_s": safe_stall_s(t), "heartbeat_loss_budget": budget}
    errors = sum(1 for f in findings if f["severity"] == "error")
    return {"ok": errors == 0, "errors": errors, "warnings": len(findings) - errors, "findings": findings,
            "timing": timing}


def render_table(report: dict[str, Any]) -> None:
    """Print a :func:`lint_report`: findings table (or "no findings"), derived timing, a summary line."""
    out = console()
    if report["findings"]:
        table = Table(title="lint findings", title_justify="left")
        for column in ("field", "severity", "message", "fix"):
            table.add_column(column, overflow="fold")
        for f in report["findings"]:
            style = "red" if f["severity"] == "error" else "yellow"
            table.add_row(escape(f["field"]), f"[{style}]{f['severity']}[/]", escape(f["message"]), escape(f["fix"]))
        out.print(table)
    else:
        out.print("no findings")
    t = report["timing"]
    if t is not None:
        budget = "undefined" if t["heartbeat_loss_budget"] is None else str(t["heartbeat_loss_budget"])
        out.print(f"derived: L={fmt_num(t['lease_duration_s'])} s, H={fmt_num(t['heartbeat_interval_s'])} s, "
                  f"E={fmt_num(t['extension_s'])} s; decoder_kv_blocks_ttl={fmt_num(t['decoder_kv_blocks_ttl_s'])} s; "
                  f"safe stall {fmt_num(t['safe_stall_s'])} s; heartbeat loss budget {budget}")
    out.print(f"{'OK' if report['ok'] else 'FAIL'}: {report['errors']} error(s), {report['warnings']} warning(s)")


def _cmd_lint(args: argparse.Namespace) -> int:
    pair = (args.prefill_vllm, args.decode_vllm)
    if args.kv_transfer_config is None and pair == (None, None):
        error("lint: nothing to lint; fix: give --kv-transfer-config JSON, or --prefill-vllm and --decode-vllm "
              "(each host's `python -c \"import vllm; print(vllm.__version__)\"`), or both")
        return EXIT_USAGE
    if None in pair and pair != (None, None):
        missing = "--decode-vllm" if args.decode_vllm is None else "--prefill-vllm"
        error(f"{missing}: missing; the pair check needs both versions; fix: add {missing} VERSION")
        return EXIT_USAGE
    config = None
    if args.kv_transfer_config is not None:
        try:
            config = read_config_argument(args.kv_transfer_config)
        except (OSError, ValueError) as exc:
            error(f"--kv-transfer-config {args.kv_transfer_config}: cannot read the file: {exc}")
            return EXIT_USAGE
    report = lint_report(config, args.prefill_vllm, args.decode_vllm)
    if args.output == "json":
        print_json(report)
    else:
        render_table(report)
    return EXIT_OK if report["ok"] else EXIT_FAIL


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``lint`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``); returns its parser.

    The parser's ``func`` default is the handler: ``args.func(args)`` returns the exit code.
    """
    p = subparsers.add_parser("lint", help="lint a vLLM --kv-transfer-config for the KV lease, and a P/D pair's vLLM "
                                           "versions",
                              description=(
                                  "Lint a vLLM --kv-transfer-config for the KV lease and print the derived L, H, E; "
                                  "with --prefill-vllm and --decode-vllm, also refuse a P/D pair on an unsupported "
                                  "or mixed vLLM release (vLLM refuses the handshake between 0.32.0 and 0.33.0). "
                                  "Exit codes: 0 no error finding (warnings allowed); 1 an error; 2 bad usage."))
    p.add_argument("--kv-transfer-config", metavar="JSON",
                   help="the JSON passed to vLLM, or @path to a file holding it")
    p.add_argument("--prefill-vllm", metavar="VERSION",
                   help="vllm.__version__ on the prefill (P) host (python -c 'import vllm; print(vllm.__version__)')")
    p.add_argument("--decode-vllm", metavar="VERSION", help="vllm.__version__ on the decode (D) host")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.set_defaults(func=_cmd_lint)
    return p
