"""A small client for a real Toxiproxy server's HTTP API, and :class:`ToxiproxyFault`.

Toxiproxy (Shopify) is a TCP proxy whose faults ("toxics": latency, bandwidth, timeout,
reset_peer, slicer, slow_close, limit_data) are set over HTTP. None runs on the CPU hosts; where
one does (GPU CI), set ``TOXIPROXY_URL`` (e.g. ``http://127.0.0.1:8474``) to enable these faults.

Endpoints used: ``POST /proxies``, ``POST /proxies/{proxy}`` (enable/disable),
``DELETE /proxies/{proxy}``, ``POST /proxies/{proxy}/toxics``,
``DELETE /proxies/{proxy}/toxics/{toxic}``, ``GET /version``.
"""

from __future__ import annotations

import math
import os
import re

import httpx

from leasekit.chaos.faults._common import FaultError, stamp

ENV_URL = "TOXIPROXY_URL"
STREAMS = ("downstream", "upstream")
TOXIC_TYPES = ("latency", "bandwidth", "slow_close", "timeout", "reset_peer", "slicer", "limit_data")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ADDR_RE = re.compile(r"^\[?[A-Za-z0-9_.:-]*\]?:\d{1,5}$")


class ToxiproxyError(FaultError):
    """The Toxiproxy server answered with an error; ``status`` is its HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


def _check_name(field: str, value: object) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(f"{field} must be 1-64 characters of [A-Za-z0-9_.-], got {value!r}")
    return value


def _check_addr(field: str, value: object) -> str:
    if not isinstance(value, str) or not _ADDR_RE.match(value) or not 0 <= int(value.rsplit(":", 1)[1]) <= 65535:
        raise ValueError(f"{field} must be 'host:port' with port in 0..65535, got {value!r}")
    return value


def _check_toxic(type: str, stream: str, toxicity: float, attributes: dict) -> None:
    if type not in TOXIC_TYPES:
        raise ValueError(f"type must be one of {TOXIC_TYPES}, got {type!r}")
    if stream not in STREAMS:
        raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")
    if isinstance(toxicity, bool) or not isinstance(toxicity, (int, float)) or not (
            math.isfinite(toxicity) and 0.0 <= toxicity <= 1.0):
        raise ValueError(f"toxicity must be a number in 0.0..1.0, got {toxicity!r}")
    if not isinstance(attributes, dict):  # every bad argument is a ValueError naming its field
        raise ValueError(f"attributes must be a dict (e.g. {{'latency': 100}}), got {attributes!r}")  # noqa: TRY004


class ToxiproxyClient:
    """HTTP client for one Toxiproxy server at ``url`` (``http://host:8474``).

    Args:
        url: the API base URL.
        timeout_s: per-request timeout in seconds (> 0).

    Raises:
        ValueError: ``url`` is not ``http(s)://...`` or ``timeout_s`` is not > 0.
    """

    def __init__(self, url: str, timeout_s: float = 5.0):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    @classmethod
    def from_env(cls) -> ToxiproxyClient | None:
        """A client for ``$TOXIPROXY_URL``, or None when it is unset (Toxiproxy faults disabled)."""
        url = os.environ.get(ENV_URL, "").strip()
        return cls(url) if url else None

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()

    def _call(self, method: str, path: str, body: dict | None = None) -> dict | None:
        try:
            response = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise ToxiproxyError(f"toxiproxy {method} {self.url}{path}: no answer ({exc})") from exc
        if response.status_code >= 400:
            try:
                detail = response.json().get("error", response.text)
            except ValueError:
                detail = response.text
            raise ToxiproxyError(f"toxiproxy {method} {path}: HTTP {response.status_code}: {detail}",
                                 response.status_code)
        return response.json() if response.content else None

    def version(self) -> str:
        """The server's version string (``GET /version``)."""
        response = self._http.get("/version")
        response.raise_for_status()
        return response.text.strip()

    def create_proxy(self, name: str, listen: str, upstream: str, *, enabled: bool = True) -> dict:
        """``POST /proxies``: listen on ``listen`` (``host:port``; port 0 lets the server pick)
        and forward to ``upstream``. Returns the proxy as the server reports it (actual listen).

        Raises:
            ValueError: malformed name/listen/upstream. ToxiproxyError: e.g. HTTP 409, name taken.
        """
        body = {"name": _check_name("name", name), "listen": _check_addr("listen", listen),
                "upstream": _check_addr("upstream", upstream), "enabled": bool(enabled)}
        return self._call("POST", "/proxies", body) or {}

    def set_enabled(self, proxy: str, enabled: bool) -> dict:
        """``POST /proxies/{proxy}``: a disabled proxy closes its connections and refuses new ones."""
        return self._call("POST", f"/proxies/{_check_name('proxy', proxy)}", {"enabled": bool(enabled)}) or {}

    def delete_proxy(self, proxy: str) -> None:
        """``DELETE /proxies/{proxy}``. Raises ToxiproxyError (404: no such proxy)."""
        self._call("DELETE", f"/proxies/{_check_name('proxy', proxy)}")

    def add_toxic(self, proxy: str, type: str, attributes: dict | None = None, *,
                  stream: str = "downstream", toxicity: float = 1.0, name: str | None = None) -> dict:
        """``POST /proxies/{proxy}/toxics``: add a toxic (e.g. ``"latency", {"latency": 500}``,
        milliseconds as Toxiproxy defines them). ``name`` defaults to ``<type>_<stream>``.
        Returns the toxic as the server reports it.

        Raises:
            ValueError: type/stream/toxicity (0.0..1.0)/attributes/name invalid.
            ToxiproxyError: the server refused (e.g. 404 proxy, 409 toxic name taken).
        """
        attributes = {} if attributes is None else attributes
        _check_toxic(type, stream, toxicity, attributes)
        name = _check_name("name", name if name is not None else f"{type}_{stream}")
        body = {"name": name, "type": type, "stream": stream, "toxicity": float(toxicity),
                "attributes": attributes}
        return self._call("POST", f"/proxies/{_check_name('proxy', proxy)}/toxics", body) or {}

    def remove_toxic(self, proxy: str, toxic: str) -> None:
        """``DELETE /proxies/{proxy}/toxics/{toxic}``. Raises ToxiproxyError (404: not there)."""
        self._call("DELETE", f"/proxies/{_check_name('proxy', proxy)}/toxics/{_check_name('toxic', toxic)}")


class ToxiproxyFault:
    """One toxic on an existing proxy as an injector: ``inject`` adds it, ``recover`` and
    ``cleanup`` (idempotent; a toxic already gone is fine) remove it. Arguments are validated at
    construction. ``record`` (in place): proxy, toxic name/type/stream/toxicity/attributes and
    ``injected_*``/``recovered_*`` stamps (``_monotonic_s``: ``time.monotonic()``, ``_wall_s``:
    ``time.time()``).

    Raises:
        ValueError: see :meth:`ToxiproxyClient.add_toxic`.
    """

    def __init__(self, client: ToxiproxyClient, proxy: str, type: str, attributes: dict | None = None, *,
                 stream: str = "downstream", toxicity: float = 1.0, name: str | None = None):
        attributes = {} if attributes is None else attributes
        _check_toxic(type, stream, toxicity, attributes)
        self.client, self.proxy = client, _check_name("proxy", proxy)
        self.name = _check_name("name", name if name is not None else f"leasekit_{type}_{stream}")
        self.params = {"type": type, "attributes": dict(attributes), "stream": stream, "toxicity": toxicity}
        self.active = False
        self.record: dict = {}

    def inject(self) -> None:
        """Add the toxic now. Raises FaultError if already injected, ToxiproxyError if refused."""
        if self.active:
            raise FaultError(f"ToxiproxyFault {self.name} already injected on {self.proxy}")
        self.record.clear()
        self.record.update({"kind": "toxiproxy", "url": self.client.url, "proxy": self.proxy,
                            "toxic": self.name, **self.params})
        stamp(self.record, "injected")
        p = self.params
        self.active = True  # before the request: a timed-out add may still have been applied
        self.client.add_toxic(self.proxy, p["type"], p["attributes"], stream=p["stream"],
                              toxicity=p["toxicity"], name=self.name)
        stamp(self.record, "applied")

    def recover(self) -> None:
        """Remove the toxic (404, already gone, is fine); no-op if not injected."""
        if not self.active:
            return
        try:
            self.client.remove_toxic(self.proxy, self.name)
        except ToxiproxyError as exc:
            if exc.status != 404:
                raise
        self.active = False
        stamp(self.record, "recovered")

    def cleanup(self) -> None:
        """Make sure the toxic is gone; idempotent."""
        self.recover()
