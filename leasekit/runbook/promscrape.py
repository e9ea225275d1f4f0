"""Scraping a vLLM server's ``/metrics`` and reading the samples: the I/O half of ``leasekit status``.

Parsing is prometheus-client's own (``prometheus_client.parser.text_string_to_metric_families``);
nothing here re-implements the exposition format. Series are kept by sample name (counters as
``<name>_total``, as scraped) so families exported without ``# TYPE`` lines are read the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from leasekit.telemetry.metrics import LEASEKIT_METRICS, VLLM_NIXL_METRICS, MetricSpec

LabelKey = tuple[tuple[str, str], ...]
"""A series' labels as a sorted tuple of ``(name, value)`` pairs (hashable)."""


def _monotonic_sample_names() -> frozenset[str]:
    names: set[str] = set()
    specs = list(LEASEKIT_METRICS) + [MetricSpec(n, k, "", (), "both") for n, k in VLLM_NIXL_METRICS.items()]
    for spec in specs:
        if spec.kind in ("counter", "histogram"):
            names.update(spec.sample_names)
    return frozenset(names)


MONOTONIC_SAMPLE_NAMES = _monotonic_sample_names()
"""Sample names that only grow while a server runs (counters' ``_total``; histograms' ``_bucket``,
``_sum``, ``_count``), from the catalog :mod:`leasekit.telemetry.metrics`. Deltas are taken on these;
gauges keep their latest value."""


def metrics_url(url: str) -> str:
    """The ``/metrics`` URL of a server given as ``host:port``, ``http://host:port[/]`` or the full
    ``.../metrics`` URL. A missing scheme means ``http``; a path other than ``/metrics`` gets
    ``/metrics`` appended (``http://h:8000/v1`` -> ``http://h:8000/v1/metrics``).

    Raises:
        ValueError: ``url`` is not a server address (empty, spaces, a scheme other than http/https, no host,
            a bad port or IPv6 literal); the message names the URL and the accepted forms.
    """
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    accepted = "give host:port, http://host:port or its full /metrics URL"
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - reading it raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"server URL {url!r} is not valid ({exc}): {accepted}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in text):
        raise ValueError(f"server URL {url!r} is not valid (scheme http or https, a host, no spaces): {accepted}")
    path = parts.path.rstrip("/")
    if not path.endswith("/metrics"):
        path += "/metrics"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


@dataclass(frozen=True)
class Sample:
    """One scraped series value: sample ``name`` (e.g. ``leasekit_kv_lease_grants_total``), its
    ``labels`` and ``value`` (seconds for ``*_seconds`` metrics)."""

    name: str
    labels: dict[str, str]
    value: float

    @property
    def key(self) -> tuple[str, LabelKey]:
        """``(name, sorted labels)``: identifies the series across scrapes."""
        return self.name, tuple(sorted(self.labels.items()))


def parse_exposition(text: str) -> tuple[list[Sample], frozenset[str]]:
    """Every sample of a Prometheus text exposition, in order, and the family names it declares.

    A family is declared by its ``# TYPE``/``# HELP`` lines even with no samples, as a labelled
    metric is before its first child exists (a LeaseKit server with no lease yet); counter family
    names are without ``_total`` (prometheus-client's parser), as :mod:`leasekit.telemetry.metrics`
    names them.

    Raises:
        ValueError: the text is not in the Prometheus text format (prometheus-client's parser).
    """
    samples: list[Sample] = []
    families: set[str] = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for s in family.samples:
            samples.append(Sample(s.name, dict(s.labels), float(s.value)))
    return samples, frozenset(families)


@dataclass
class Scrape:
    """The outcome of one GET of a ``/metrics`` URL.

    Attributes:
        url: the ``/metrics`` URL fetched.
        samples: parsed samples ([] on failure).
        families: family names the exposition declares (see :func:`parse_exposition`).
        error: None on success, else why the scrape failed (names the URL and the cause).
        parse_error: True when the server answered 200 but the body was not Prometheus text.
        at_s: ``time.monotonic()`` seconds when the response arrived (or the failure happened).
    """

    url: str
    samples: list[Sample] = field(default_factory=list)
    families: frozenset[str] = frozenset()
    error: str | None = None
    parse_error: bool = False
    at_s: float = 0.0


MAX_METRICS_BYTES = 16 << 20
"""The largest ``/metrics`` body read (a vLLM server's is well under 1 MiB); a larger one is an error."""


class _TooSlowOrLarge(Exception):
    """A ``/metrics`` answer that took longer than the timeout in all, or is larger than :data:`MAX_METRICS_BYTES`."""


def _get_bounded(client: httpx.Client, url: str, timeout_s: float) -> tuple[int, str, bytes]:
    """``(status, reason, body)`` of GET ``url``, the whole answer within ``timeout_s`` seconds and at most
    :data:`MAX_METRICS_BYTES` (a server trickling bytes cannot hold ``leasekit status`` past its timeout).

    Raises:
        httpx.HTTPError: transport errors; _TooSlowOrLarge: past the deadline or the size."""
    deadline = time.monotonic() + timeout_s
    with client.stream("GET", url, timeout=timeout_s) as response:
        chunks, size = [], 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > MAX_METRICS_BYTES:
                raise _TooSlowOrLarge(f"body larger than {MAX_METRICS_BYTES} bytes")
            if time.monotonic() > deadline:
                raise _TooSlowOrLarge(f"the answer took more than {timeout_s:g} s")
            chunks.append(chunk)
        return response.status_code, response.reason_phrase, b"".join(chunks)


def scrape(url: str, *, timeout_s: float, client: httpx.Client | None = None) -> Scrape:
    """GET ``url`` (already a ``/metrics`` URL, see :func:`metrics_url`) and parse it; never raises.

    Args:
        url: the URL to fetch.
        timeout_s: seconds for the whole answer (and httpx's connect, read, write, pool timeout).
        client: an httpx client to reuse; a fresh one is made (and closed) otherwise.

    Returns:
        A :class:`Scrape`; on any transport error, non-2xx status or unparsable body its ``error``
        says which, e.g. ``"could not scrape http://h:1/metrics: ConnectError: [Errno 111] ..."``.
    """
    own = client is None
    client = client or httpx.Client(timeout=timeout_s, follow_redirects=True)
    try:
        try:
            status, reason, body = _get_bounded(client, url, timeout_s)
        except (httpx.HTTPError, httpx.InvalidURL, _TooSlowOrLarge) as exc:
            detail = str(exc) or "no detail"
            return Scrape(url, error=f"could not scrape {url}: {type(exc).__name__}: {detail}", at_s=time.monotonic())
        at = time.monotonic()
        if not 200 <= status < 300:
            return Scrape(url, error=f"could not scrape {url}: HTTP {status} {reason}", at_s=at)
        try:
            samples, families = parse_exposition(body.decode("utf-8", errors="replace"))
            return Scrape(url, samples=samples, families=families, at_s=at)
        except (ValueError, IndexError, TypeError) as exc:
            return Scrape(url, error=f"{url} answered but not with Prometheus text: {exc}", parse_error=True, at_s=at)
    finally:
        if own:
            client.close()


def counter_deltas(before: list[Sample], after: list[Sample]) -> tuple[list[Sample], int]:
    """``after`` with every monotonic series (:data:`MONOTONIC_SAMPLE_NAMES`) replaced by its increase
    since ``before``; gauges keep their ``after`` value.

    Follows Prometheus ``increase()``: a series that went down was reset (server restart) and its
    increase is its ``after`` value; a series absent from ``before`` was created in between (children
    are created on first increment) and its increase is its ``after`` value too.

    Returns:
        The delta samples and the number of series seen to reset.
    """
    earlier = {s.key: s.value for s in before}
    out: list[Sample] = []
    resets = 0
    for s in after:
        if s.name not in MONOTONIC_SAMPLE_NAMES:
            out.append(s)
            continue
        prev = earlier.get(s.key)
        if prev is None:
            delta = s.value
        elif s.value < prev:
            resets += 1
            delta = s.value
        else:
            delta = s.value - prev
        out.append(Sample(s.name, s.labels, delta))
    return out, resets
