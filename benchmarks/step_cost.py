"""Per-engine-step cost of the production worker classes: vLLM 0.32.0's ``NixlPullConnectorWorker``
(stock) against LeaseKit's ``LeaseKitPullWorker``, both called as the engine calls them every step.

For each N (default 1k, 10k, 100k live leases on P) it builds three P workers, stock, LeaseKit with its
default span export (span file in a temporary run dir, OTLP off) and LeaseKit with export off
(``OTEL_SDK_DISABLED=true``), puts N leases live through the scheduler and ``start_load_kv``, and times,
interleaved A B B A:

- the engine step with nothing new (``benchmarks/pstep/drive.py`` ``engine_step``: the worker calls of
  ``vllm/v1/worker/kv_connector_model_runner_mixin.py`` ``_get_kv_connector_output``);
- the step handling one heartbeat naming 16 leases and one completion, minus the empty step before it.

Then memory per live lease at N = 10k (tracemalloc, after the grants and after 64 heartbeats each);
blocked span sinks (:mod:`benchmarks.pstep.blocked`, N = 10k): LeaseKit P with a normal span file, with
its span file frozen, and also exporting by OTLP to an endpoint that never answers, 3000 notification
steps each, interleaved A B C C B A; and D's step with N tracked requests waiting (default 1k, 10k): a
step with nothing due and a step sending the heartbeat of all of them. Medians over the timed steps;
ratios against stock (blocked sinks: against the normal span file); PASS/FAIL per goal.

Run: ``.venv/bin/python benchmarks/step_cost.py [--sizes 1000,10000,100000] [--steps 200] [--quick]
[--blocked-n 10000] [--blocked-steps 3000] [--blocked-otlp-timeout 10] [-o table|json] [--json PATH]``.
Exit code 0 whatever the verdicts (non-zero only on a crash).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the table or the JSON only

from benchmarks.pstep import report as R  # noqa: E402

QUICK = {"sizes": "1000,10000", "d_sizes": "1000", "steps": 60, "notif_steps": 30, "d_heartbeats": 10,
         "memory_n": 2000, "blocked_n": 1000}


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes must be comma-separated integers, got {text!r}") from None
    if any(n < 20 for n in sizes):
        raise argparse.ArgumentTypeError(f"every size must be >= 20 (leases), got {text!r}")
    return sizes


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (0 skips), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 skips), got {value}")
    return value


def _writable(text: str) -> Path:
    path = Path(text)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the directory {str(path.parent)!r} does not exist (the JSON is written "
                                         "after the run: create it first)")
    return path


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 seconds and finite, got {text!r}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=_sizes, help="P: live leases N, comma-separated (default 1000,10000,100000; "
                   "'' skips P)")
    p.add_argument("--d-sizes", type=_sizes, help="D: tracked requests N (default 1000,10000; '' skips D)")
    p.add_argument("--steps", type=_positive, help="timed empty steps per worker and N (default 200)")
    p.add_argument("--notif-steps", type=_positive, help="timed notification steps per worker and N (default 100)")
    p.add_argument("--d-heartbeats", type=_positive, help="timed D heartbeat steps per worker and N (default 40)")
    p.add_argument("--rounds", type=_positive, default=4, help="A B B A rounds the steps are split over (default 4)")
    p.add_argument("--memory-n", type=_count, help="N for memory per lease (default 10000; 0 skips)")
    p.add_argument("--memory-heartbeats", type=_positive, default=64, help="heartbeats per lease (default 64)")
    p.add_argument("--blocked-n", type=_count, help="N live leases for the blocked-span-sink comparison (normal, "
                   "frozen span file, OTLP endpoint that never answers; default 10000; 0 skips)")
    p.add_argument("--blocked-steps", type=_positive, default=3000,
                   help="notification steps per worker there (default 3000: more spans than the export queue holds)")
    p.add_argument("--blocked-otlp-timeout", type=_seconds, default=10.0,
                   help="OTEL_EXPORTER_OTLP_TIMEOUT of the OTLP side there, seconds (default 10, OpenTelemetry's)")
    p.add_argument("--memory-export-off", action="store_true",
                   help="also measure memory on LeaseKit with export off (about 1 min more at N=10k)")
    p.add_argument("--quick", action="store_true", help="a smoke run: N 1k,10k; D 1k; fewer steps; memory at 2k")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table", help="what to print at the end")
    p.add_argument("--json", type=_writable, help="also write the result as JSON to this file")
    args = p.parse_args(argv)
    defaults = {"sizes": "1000,10000,100000", "d_sizes": "1000,10000", "steps": 200, "notif_steps": 100,
                "d_heartbeats": 40, "memory_n": 10_000, "blocked_n": 10_000}
    for key, value in (QUICK if args.quick else defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, _sizes(value) if key in ("sizes", "d_sizes") else value)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, _sizes(value) if key in ("sizes", "d_sizes") else value)
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def teardown(sides) -> None:
    """Shut the workers down as the engine does at exit (LeaseKit ends open lease spans)."""
    logging.disable(logging.INFO)  # one INFO record per lease still open (LeaseKit's abort at shutdown)
    try:
        for side in sides:
            side.connector.shutdown()
            side.scheduler.shutdown()
        sides.clear()
        gc.collect()
    finally:
        logging.disable(logging.NOTSET)


def make_sides(v, cls, tmp: Path, tag: str, model_dir: str) -> list:
    """Stock, LeaseKit (export on) and LeaseKit (export off) sides of class ``cls`` (``PSide``/``DSide``)."""
    return [cls(v, R.STOCK, leasekit=False, model_dir=model_dir, run_dir=None),
            cls(v, R.LEASEKIT, leasekit=True, model_dir=model_dir, run_dir=str(tmp / f"{tag}-export-on")),
            cls(v, R.LEASEKIT_OFF, leasekit=True, export=False, model_dir=model_dir,
                run_dir=str(tmp / f"{tag}-export-off"))]


def run_p(v, args: argparse.Namespace, n: int, tmp: Path, model_dir: str) -> dict:
    """P at ``n`` live leases: empty steps, then notification steps; per-side summaries."""
    from benchmarks.pstep import drive as D
    from benchmarks.pstep import measure as M

    started = time.perf_counter()
    sides = make_sides(v, D.PSide, tmp, f"p{n}", model_dir)
    by_label = {side.label: side for side in sides}
    driver = M.PDriver(sides, n)
    log(f"P N={n}: {n} leases granted on each of {len(sides)} workers in {time.perf_counter() - started:.1f} s")
    steps, reps = M.split(args.steps, args.rounds), M.split(args.notif_steps, args.rounds)
    M.interleave(list(by_label), args.rounds, lambda label, k: driver.empty_block(by_label[label], steps[k]))
    M.interleave(list(by_label), args.rounds, lambda label, k: driver.notif_block(by_label[label], reps[k]))
    entry = {"n": n, **{label: driver.samples[label].summary() for label in by_label}}
    teardown(sides)
    log(f"P N={n}: done in {time.perf_counter() - started:.1f} s")
    return entry


def run_memory(v, args: argparse.Namespace, tmp: Path, model_dir: str) -> dict:
    """Memory per live lease on each kind of P worker, one after the other."""
    from benchmarks.pstep import drive as D
    from benchmarks.pstep import measure as M

    out = {}
    kinds = [(R.STOCK, False, True), (R.LEASEKIT, True, True)]
    if args.memory_export_off:
        kinds.append((R.LEASEKIT_OFF, True, False))
    for label, leasekit, export in kinds:
        started = time.perf_counter()
        side = D.PSide(v, label, leasekit=leasekit, export=export, model_dir=model_dir,
                       run_dir=str(tmp / f"memory-{label}") if leasekit else None)
        out[label] = M.memory_per_lease(side, args.memory_n, args.memory_heartbeats)
        teardown([side])
        del side
        gc.collect()
        log(f"memory N={args.memory_n} {label}: {time.perf_counter() - started:.1f} s")
    return out


def run_blocked(v, args: argparse.Namespace, tmp: Path, model_dir: str) -> dict:
    """LeaseKit P with a normal span file against LeaseKit P whose span file is frozen and LeaseKit P
    that also exports by OTLP to an endpoint that never answers (:mod:`benchmarks.pstep.blocked`),
    ``args.blocked_n`` live leases each, ``args.blocked_steps`` notification steps each, interleaved
    A B C C B A. Returns ``{"n", "steps", "otlp_timeout_s", <label>: summary + dropped + failed + settled}``
    (:class:`benchmarks.pstep.measure.Samples` summary, µs; spans), the OTLP side with ``sinks`` too."""
    from benchmarks.pstep import blocked as K
    from benchmarks.pstep import drive as D
    from benchmarks.pstep import measure as M

    started = time.perf_counter()
    n = args.blocked_n
    with K.frozen_span_dir(tmp / "blocked-frozen"), K.otlp_black_hole() as url:
        sides = [D.PSide(v, R.LEASEKIT, leasekit=True, model_dir=model_dir, run_dir=str(tmp / "blocked-normal")),
                 D.PSide(v, R.LEASEKIT_BLOCKED, leasekit=True, model_dir=model_dir,
                         run_dir=str(tmp / "blocked-frozen"))]
        sides.append(D.PSide(v, R.LEASEKIT_OTLP_BLOCKED, leasekit=True, model_dir=model_dir,  # OTLP: this side only
                             run_dir=str(tmp / "blocked-otlp"), extra_env=K.otlp_env(url, args.blocked_otlp_timeout)))
        by_label = {side.label: side for side in sides}
        driver = M.PDriver(sides, n)
        reps = M.split(args.blocked_steps, args.rounds)
        M.interleave(list(by_label), args.rounds, lambda label, k: driver.notif_block(by_label[label], reps[k]))
        # counts are read once every ended lease's span reached the sinks (built off-step); "settled": False if not
        settled = {label: K.settle(side.worker) for label, side in by_label.items()}
        entry = {"n": n, "steps": args.blocked_steps, "otlp_timeout_s": args.blocked_otlp_timeout,
                 **{label: {**driver.samples[label].summary(), **K.unexported(by_label[label].worker),
                            "settled": settled[label]} for label in by_label}}
        for label in (label for label, done in settled.items() if not done):
            log(f"blocked span sinks: {label}'s span builder still had spans to build after 10 s: its counts are short")
        entry[R.LEASEKIT_OTLP_BLOCKED]["sinks"] = K.sink_counts(by_label[R.LEASEKIT_OTLP_BLOCKED].worker)
        teardown(sides)  # the OTLP side's shutdown waits up to the OTLP timeout for its stuck export
    log(f"blocked span sinks N={n}: done in {time.perf_counter() - started:.1f} s")
    return entry


def run_d(v, args: argparse.Namespace, n: int, tmp: Path, model_dir: str) -> dict:
    """D with ``n`` tracked requests waiting: empty steps and heartbeat steps; per-side summaries."""
    from benchmarks.pstep import drive as D
    from benchmarks.pstep import measure as M

    started = time.perf_counter()
    sides = make_sides(v, D.DSide, tmp, f"d{n}", model_dir)
    by_label = {side.label: side for side in sides}
    driver = M.DDriver(sides, n)
    steps, beats = M.split(args.steps, args.rounds), M.split(args.d_heartbeats, args.rounds)
    M.interleave(list(by_label), args.rounds, lambda label, k: driver.block(by_label[label], steps[k], beats[k]))
    entry = {"n": n, **{label: driver.samples[label].summary() for label in by_label}}
    teardown(sides)
    log(f"D N={n}: done in {time.perf_counter() - started:.1f} s")
    return entry


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark; returns the result (see :mod:`benchmarks.pstep.report`)."""
    from benchmarks.pstep import build as B
    from leasekit.cluster.model import write_tiny_llama

    v = B.load_vllm()
    result: dict = {"config": {
        "vllm": v.version, "python": platform.python_version(), "cpus": os.cpu_count(),
        "lease_duration_s": B.LEASE_DURATION_S, "sizes": args.sizes, "d_sizes": args.d_sizes,
        "steps": args.steps, "notif_steps": args.notif_steps, "d_heartbeats": args.d_heartbeats,
        "rounds": args.rounds, "memory_n": args.memory_n, "memory_heartbeats": args.memory_heartbeats,
        "memory_export_off": args.memory_export_off, "blocked_n": args.blocked_n,
        "blocked_steps": args.blocked_steps, "blocked_otlp_timeout_s": args.blocked_otlp_timeout,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_start": list(os.getloadavg()),
    }, "p": [], "memory": {}, "d": []}
    with tempfile.TemporaryDirectory(prefix="leasekit-step-cost-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = str(write_tiny_llama(tmp / "tiny-llama"))
        for n in args.sizes:
            result["p"].append(run_p(v, args, n, tmp, model_dir))
            gc.collect()  # the workers go now (vLLM's __del__ shuts them down), not at interpreter exit
        if args.memory_n > 0:
            result["memory"] = run_memory(v, args, tmp, model_dir)
        if args.blocked_n > 0:
            result["blocked"] = run_blocked(v, args, tmp, model_dir)
        for n in args.d_sizes:
            result["d"].append(run_d(v, args, n, tmp, model_dir))
            gc.collect()
    result["config"]["loadavg_end"] = list(os.getloadavg())
    result["goals"] = R.goals(result)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    result = run(args)
    result["config"]["wall_s"] = round(time.perf_counter() - started, 1)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.output == "json":
        print(json.dumps(result, indent=2))
    else:
        print(R.render(result))
        load = ", ".join(f"{x:.1f}" for x in result["config"]["loadavg_start"])
        print(f"\n(wall time {result['config']['wall_s']} s on {os.cpu_count()} CPUs, load average at start {load}; "
              f"medians over timed engine steps; gc off while timed; A B B A order over {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
