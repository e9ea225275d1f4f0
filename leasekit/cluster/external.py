"""A P/D pair that somebody else started (a GPU fleet, a staging cluster): only its URLs and the
directory its LeaseKitConnector writes to are known, so leasekit can send traffic, read the lease
spans and drive the connector's fault points, but cannot kill, stop, skew or partition its
processes. Scenarios needing that are refused with the reason
(:func:`leasekit.chaos.pool.unsupported_reason`).

Pointing the chaos suite at such a pair: start P and D with LeaseKitConnector,
``"leasekit_run_dir": DIR`` in ``kv_connector_extra_config`` (spans go to ``DIR/spans``),
``LEASEKIT_FAULT_FILE=DIR/faults/<prefill|decode>.json`` in each server's environment,
``--served-model-name leasekit-tiny`` (the name the router sends), ``--max-num-seqs 1`` on D (the
workloads queue requests behind D's one running slot) and ``kv_lease_duration`` 6 (the catalog's
fault times are written for L = 6 s); on the same host as the tests (loopback URLs) for the
checks that compare instants on P's clock; then
``pytest -m chaos --leasekit-prefill-url URL --leasekit-decode-url URL --leasekit-pair-dir DIR``.
"""

from __future__ import annotations

import random
from urllib.parse import urlsplit
from pathlib import Path

import httpx

from leasekit.cluster.pair import PairSpec, random_prompt
from leasekit.cluster.router import Router
from leasekit.cluster.server import scrape_metrics
from leasekit.cluster.vllmrelease import UNKNOWN_RELEASE, measure_pair


class ExternalPairError(RuntimeError):
    """The external pair is unreachable, or an operation needs process control it does not give."""


class RemoteServer:
    """One server known only by URL. ``pids`` is empty: no signal can reach it from here.

    Args:
        url: base URL, e.g. ``http://10.0.0.5:8000``.
        log_path: its log file if readable here (the stock connector's only lease evidence).
    """

    def __init__(self, url: str, log_path: str | Path | None = None):
        self.url = url.rstrip("/")
        self.log_path = Path(log_path) if log_path else Path("/nonexistent/leasekit-external.log")
        self.pids: list[int] = []

    def api_server_pid(self) -> None:
        """None: the process is not ours (so its clock offset cannot be read; checks that convert
        runner instants to P's clock report UNKNOWN)."""
        return None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """``GET /health`` answered 200 within ``timeout_s`` seconds."""
        try:
            return httpx.get(f"{self.url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    alive = healthy

    def metrics(self, timeout_s: float = 5.0) -> dict[str, float]:
        """Scrape ``/metrics``: ``{sample name: value}`` summed over label sets.

        Raises:
            httpx.HTTPError: the server did not answer.
        """
        return scrape_metrics(self.url, timeout_s)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log, if readable here."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(log not readable here)"


class ExternalPair:
    """The :class:`~leasekit.cluster.pair.PDPair` surface the chaos suite uses, for a running pair.

    Args:
        prefill_url / decode_url: the servers' base URLs.
        pair_dir: the connectors' ``leasekit_run_dir`` as seen from here (``spans/``, ``faults/``).
        target: ``leasekit`` or ``stock`` (what both sides run).
        lease_duration_s: the pair's ``kv_lease_duration`` in seconds.
        prefill_log: P's log file, needed for ``stock`` evidence.

    Raises:
        ExternalPairError: a server does not answer ``/health`` (from :meth:`start`).
    """

    netns = None

    def __init__(self, prefill_url: str, decode_url: str, pair_dir: str | Path, *, target: str = "leasekit",
                 lease_duration_s: float = 30, prefill_log: str | Path | None = None):
        self.run_dir = Path(pair_dir).resolve()
        self.prefill = RemoteServer(prefill_url, prefill_log)
        self.decode = RemoteServer(decode_url)
        self.spec = PairSpec(prefill_connector=target, decode_connector=target, lease_duration_s=lease_duration_s,
                             fault_files=target == "leasekit", lease_logging=target == "stock")
        self.router: Router | None = None
        self.vllm_releases: dict[str, str] = {}  # role -> what its GET /version reported (set by start)
        self.vllm_release = UNKNOWN_RELEASE
        self.rng = random.Random(0)
        host = urlsplit(self.prefill.url).hostname or ""
        self.shares_host_clock = host in ("127.0.0.1", "localhost", "::1")
        """P runs on this host (a loopback URL): its ``perf_counter`` is this host's monotonic clock,
        so runner instants need no conversion (true unless P runs in its own time namespace)."""

    def start(self) -> "ExternalPair":
        """Check both servers answer and open the router (starts nothing)."""
        for role, server in (("prefill", self.prefill), ("decode", self.decode)):
            if not server.healthy(5.0):
                raise ExternalPairError(f"external {role} server {server.url} does not answer /health")
        self.router = Router(self.prefill.url, self.decode.url)
        self.vllm_releases, self.vllm_release = measure_pair(self)  # each server's GET /version
        return self

    def matches(self, spec: PairSpec) -> str | None:
        """Why this pair cannot stand in for ``spec`` (None if it can)."""
        if spec.prefill_connector != self.spec.prefill_connector:
            return f"the external pair runs {self.spec.prefill_connector}, the scenario wants {spec.prefill_connector}"
        if spec.transfer_mode != self.spec.transfer_mode:
            return (f"the scenario runs in {spec.transfer_mode} mode; an external pair is taken to run "
                    f"{self.spec.transfer_mode} mode (NixlConnector/LeaseKitConnector)")
        if spec.decode_max_num_seqs != 1:
            return "the scenario needs D with more than one running slot; the external D is assumed to run --max-num-seqs 1"
        if float(spec.lease_duration_s) != float(self.spec.lease_duration_s):
            return (f"the external pair has kv_lease_duration {self.spec.lease_duration_s:g} s, the scenario "
                    f"{spec.lease_duration_s:g} s (pass --leasekit-lease-duration to run the catalog at the pair's L)")
        return None

    def fault_file(self, role: str) -> Path:
        """The connector fault-control file of ``role`` under the pair directory."""
        return self.run_dir / "faults" / f"{role}.json"

    @property
    def span_dir(self) -> Path:
        """Where the pair's LeaseKitConnector workers write span files."""
        return self.run_dir / "spans"

    def prompt(self, length: int = 48) -> list[int]:
        """A fresh random prompt of ``length`` token ids (distinct prompts avoid prefix-cache hits)."""
        return random_prompt(self.rng, length)

    def restart_decode(self, *args, **kwargs):
        """Refused: leasekit did not start D.

        Raises:
            ExternalPairError: always.
        """
        raise ExternalPairError("cannot restart D of an external pair")

    def stop(self, grace_s: float = 0.0) -> None:  # noqa: ARG002
        """Close the router; the servers are left running (they are not ours)."""
        if self.router is not None:
            self.router.close()
            self.router = None
