"""The two real vLLM P/D pairs of the telemetry-overhead benchmark: building them on fixed ports,
starting them, parking (SIGSTOP) and unparking them, draining them to quiescence, scraping their
``leasekit_*`` metrics and stopping them. leasekit's cluster code and vLLM's dependencies are
imported only when a function needs them."""

from __future__ import annotations

import random
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .spans import SpanCounter
from .stats import TARGETS, RunStats


class HarnessError(RuntimeError):
    """The benchmark could not measure (requests did not route, a pair did not drain)."""


def log(msg: str) -> None:
    """One progress line, ``[HH:MM:SS] msg``, on stderr (stdout carries only the report)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fixed_ports(count: int, spacing: int = 10) -> list[int]:
    """``count`` free TCP ports on 127.0.0.1 below the kernel's ephemeral range, ``spacing`` apart.

    ``VllmServer`` otherwise picks its HTTP and NIXL side-channel ports with ``procs.free_port()``
    (bind port 0, release): a port in the ephemeral range that a concurrently starting server, or
    any outgoing connection, can take before vLLM binds it. Measured here: the leasekit P's
    handshake listener died with ``Address already in use`` while the other pair started, and P
    never became healthy. Ports below the ephemeral range are only ever taken by explicit binds.

    Raises:
        HarnessError: no such ports found in 50 random tries.
    """
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(50):
        base = rng.randrange(10000, max(10001, low - spacing * count))
        ports = [base + spacing * i for i in range(count)]
        try:
            for port in ports:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return ports
    raise HarnessError(f"no {count} free ports below the ephemeral range (starts at {low})")


def other_vllm_servers() -> list[str]:
    """Command lines (``<pid>: <first 120 characters>``) of vLLM API servers running before this
    benchmark started any. Never raises."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if "vllm.entrypoints" in cmd:
            found.append(f"{proc.info['pid']}: {cmd[:120]}")
    return found


def make_pairs(args, run_dir: Path) -> dict[str, Any]:
    """The two (not yet launched) ``PDPair``\\ s, ``{"stock": ..., "leasekit": ...}``, with the same
    connector on both sides, logs and spans under ``<run_dir>/<target>-pair``, and every server's
    HTTP and side-channel port fixed (:func:`fixed_ports`). ``args`` are the command's options
    (``lease_duration`` and ``start_timeout`` in seconds, ``decode_max_seqs``, ``transfer_mode``: ``pull`` compares
    LeaseKitConnector with NixlConnector, ``push`` LeaseKitPushConnector with NixlPushConnector).

    Raises:
        HarnessError: no free ports.
    """
    from leasekit.cluster.pair import PairSpec, PDPair

    pairs = {}
    for name in TARGETS:
        spec = PairSpec.pinned(prefill_connector=name, decode_connector=name, lease_duration_s=args.lease_duration,
                               decode_max_num_seqs=args.decode_max_seqs,
                               transfer_mode=getattr(args, "transfer_mode", "pull"))
        pairs[name] = PDPair(spec, run_dir / f"{name}-pair", start_timeout_s=args.start_timeout)
    ports = iter(fixed_ports(4 * len(pairs)))
    for p in pairs.values():
        for server in (p.prefill, p.decode):  # start() keeps ports set before it (see fixed_ports)
            server.http_port, server.side_channel_port = next(ports), next(ports)
    return pairs


def park_pair(pair) -> None:
    """SIGSTOP both servers of a drained pair. ``VllmServer.park()`` only parks background spares
    (``idle``), so the group is signalled here and ``parked`` set: ``unpark()`` and ``stop()`` send the
    SIGCONT (a stopped server would otherwise sit on the SIGTERM until the SIGKILL)."""
    from leasekit.cluster import procs

    for server in (pair.decode, pair.prefill):
        if server.proc is not None and not server.parked:
            server.parked = procs.signal_group(server.proc.pid, signal.SIGSTOP)


def unpark_pair(pair) -> None:
    """SIGCONT both servers (P first: D's heartbeats and reads go to P)."""
    for server in (pair.prefill, pair.decode):
        server.unpark()


def switch_pair(pairs: Mapping[str, Any], active: str | None, name: str) -> str:
    """Park the ``active`` pair (None: none is unparked) and unpark ``name``; returns ``name``."""
    if active is not None:
        park_pair(pairs[active])
    unpark_pair(pairs[name])
    return name


class Target:
    """One pair and what is measured on it.

    Attributes:
        name: ``stock`` or ``leasekit``.
        pair: its ``PDPair``.
        spans: a :class:`.spans.SpanCounter` on the pair's span directory.
        runs: its measured rounds, in order.
        drain_s: how long each :meth:`drain` waited (seconds).
    """

    def __init__(self, name: str, pair):
        self.name, self.pair = name, pair
        self.spans = SpanCounter(pair.span_dir)
        self.runs: list[RunStats] = []
        self.drain_s: list[float] = []

    @property
    def router(self):
        """The started pair's ``Router`` (P -> D).

        Raises:
            AssertionError: the pair is not started.
        """
        assert self.pair.router is not None
        return self.pair.router

    def drain(self, request_ids: Sequence[str] = (), timeout_s: float = 30.0) -> float:
        """Wait until neither server runs or queues a request, P's KV cache is empty (every lease
        released) and, on the leasekit pair, the lease span of each of ``request_ids`` is written;
        returns the seconds waited.

        Raises:
            HarnessError: not quiet within ``timeout_s`` seconds.
        """
        import httpx

        t0 = time.monotonic()
        deadline = t0 + timeout_s
        want = set(request_ids) if self.name == "leasekit" else set()
        last = "?"
        while True:
            try:
                p, d = self.pair.prefill.metrics(), self.pair.decode.metrics()
                busy = {k: v for k, v in (
                    ("P running", p.get("vllm:num_requests_running", 0)),
                    ("P waiting", p.get("vllm:num_requests_waiting", 0)),
                    ("P kv_cache_usage", p.get("vllm:kv_cache_usage_perc", 0)),
                    ("D running", d.get("vllm:num_requests_running", 0)),
                    ("D waiting", d.get("vllm:num_requests_waiting", 0)),
                ) if v}
                missing = want - set(self.spans.snapshot().leases) if want else set()
                if not busy and not missing:
                    waited = time.monotonic() - t0
                    self.drain_s.append(waited)
                    return waited
                last = f"{busy or ''} {f'{len(missing)} lease span(s) not written' if missing else ''}"
            except httpx.HTTPError as exc:
                last = f"metrics scrape failed: {exc}"
            if time.monotonic() > deadline:
                raise HarnessError(f"{self.name} pair not quiet after {timeout_s:.0f} s: {last}")
            time.sleep(0.2)


def start_pairs(pairs: Mapping[str, Any], targets: Mapping[str, Target]) -> None:
    """Launch both pairs at once and start them: stock first, leasekit as a background spare (nice,
    SCHED_BATCH) that imports vLLM in the first one's spare CPU time and is then promoted. The stock
    pair is drained and parked before leasekit's start (idle vLLM engines still spin), so on return
    stock is parked and leasekit unparked.

    Raises:
        HarnessError: the stock pair did not drain.
        Exception: whatever ``PDPair.start`` raises when a server does not come up.
    """
    t0 = time.monotonic()
    log("launching both pairs (vLLM engines take 1-2 minutes on 2 cores)")
    pairs["stock"].launch()
    pairs["leasekit"].launch(idle=True)
    pairs["stock"].start()
    log(f"stock pair up after {time.monotonic() - t0:.0f} s")
    targets["stock"].drain()
    park_pair(pairs["stock"])  # idle vLLM engines still spin: keep the cores for the other start
    pairs["leasekit"].start()
    log(f"leasekit pair up after {time.monotonic() - t0:.0f} s")


def stop_pairs(pairs: Mapping[str, Any]) -> None:
    """Stop every server of ``pairs``, SIGINT and SIGTERM held back until all are stopped (they
    arrive afterwards, so a signal cannot cut the teardown short)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        log("stopping both pairs")
        for p in pairs.values():
            p.stop()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def scrape_leasekit_metrics(target: Target) -> dict[str, dict[str, float]]:
    """The ``leasekit_*`` samples of the leasekit pair's /metrics, ``{"P": {sample: value}, "D":
    {...}}``, summed over label sets (histogram ``_bucket`` and ``_created`` samples left out: their
    sums mean nothing); a side whose scrape fails is empty (a warning is logged). Never raises."""
    out: dict[str, dict[str, float]] = {}
    for side, server in (("P", target.pair.prefill), ("D", target.pair.decode)):
        try:
            out[side] = {k: v for k, v in server.metrics().items()
                         if k.startswith("leasekit") and not k.endswith(("_bucket", "_created"))}
        except Exception as exc:  # noqa: BLE001 - informational only
            log(f"warning: could not scrape {side}'s /metrics: {exc}")
            out[side] = {}
    return out
