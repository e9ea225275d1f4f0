"""A real Prometheus server on 127.0.0.1 scraping vLLM servers, with LeaseKit's rules loaded.

Uses the ``prometheus`` binary (Debian package ``prometheus``, 2.42 here; any 2.x/3.x with the
HTTP API v1). Prometheus writes its TSDB under the given directory, listens only on loopback,
and is stopped (SIGTERM, then SIGKILL) by :meth:`PrometheusServer.stop` or on exit of the
parent (``PR_SET_PDEATHSIG`` via :func:`leasekit.cluster.procs.child_preexec`).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from leasekit.cluster import procs


class PrometheusError(RuntimeError):
    """Prometheus is missing, did not start, or answered a query with an error (message says which)."""


class PrometheusServer:
    """Start and query one Prometheus.

    Args:
        run_dir: where ``prometheus.yml``, the TSDB and ``prometheus.log`` go (created).
        targets: job name -> list of ``host:port`` targets (scraped at ``/metrics``).
        rule_files: Prometheus rule files to load (recording and alerting rules).
        scrape_interval_s / evaluation_interval_s: seconds (>= 1, Prometheus' config resolution).
        binary: the ``prometheus`` executable (default: found on PATH).

    Raises:
        PrometheusError: no ``prometheus`` binary; an interval below 1 s.
    """

    def __init__(self, run_dir: Path, targets: dict[str, list[str]], *, rule_files: list[Path] = (),
                 scrape_interval_s: int = 1, evaluation_interval_s: int = 1, binary: str | None = None):
        self.binary = binary or shutil.which("prometheus")
        if not self.binary:
            raise PrometheusError("no `prometheus` binary on PATH; fix: apt-get install prometheus (setup.sh does)")
        for name, value in (("scrape_interval_s", scrape_interval_s), ("evaluation_interval_s", evaluation_interval_s)):
            if not (isinstance(value, int) and value >= 1):
                raise PrometheusError(f"{name} must be an integer >= 1 second, got {value!r}")
        self.run_dir = Path(run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.port = procs.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = self.run_dir / "prometheus.yml"
        config = {
            "global": {"scrape_interval": f"{scrape_interval_s}s", "evaluation_interval": f"{evaluation_interval_s}s",
                       "scrape_timeout": f"{scrape_interval_s}s"},
            "rule_files": [str(Path(p).resolve()) for p in rule_files],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": list(hosts)}]} for job, hosts in targets.items()
            ],
        }
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.process: subprocess.Popen | None = None
        self._log = None
        self._http = httpx.Client(timeout=10.0)

    def start(self, timeout_s: float = 60.0) -> "PrometheusServer":
        """Start Prometheus and wait until ``/-/ready``.

        Raises:
            PrometheusError: it exited or was not ready within ``timeout_s`` seconds (log tail included).
        """
        self._log = open(self.run_dir / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [self.binary, f"--config.file={self.config_path}", f"--web.listen-address=127.0.0.1:{self.port}",
             f"--storage.tsdb.path={self.run_dir / 'tsdb'}", "--storage.tsdb.retention.time=1d",
             "--web.enable-lifecycle"],
            stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=procs.child_preexec(None),
        )
        ready = procs.wait_until(self._ready, timeout_s, 0.25)
        if not ready:
            tail = (self.run_dir / "prometheus.log").read_text(errors="replace")[-2000:]
            self.stop()
            raise PrometheusError(f"prometheus not ready on {self.url} within {timeout_s} s; log tail:\n{tail}")
        return self

    def _ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            return False
        try:
            return self._http.get(self.url + "/-/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """Stop Prometheus (SIGTERM, SIGKILL after 10 s); idempotent."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None
        self._http.close()

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _api(self, path: str, params: dict[str, Any] | None = None) -> Any:
        response = self._http.get(self.url + "/api/v1/" + path, params=params)
        body = response.json()
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        """Instant query; returns the result vector (list of ``{"metric": {...}, "value": [t, "v"]}``).

        Raises:
            PrometheusError: the query is invalid (Prometheus' error message included)."""
        params = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._api("query", params)
        result = data["result"]
        return result if data["resultType"] == "vector" else [{"metric": {}, "value": result}]

    def query_range(self, promql: str, start: float, end: float, step_s: float = 1.0) -> list[dict]:
        """Range query over ``[start, end]`` (Unix seconds); returns the matrix (list of series)."""
        return self._api("query_range", {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                         "step": f"{step_s}"})["result"]

    def targets_up(self) -> dict[str, str]:
        """``scrapeUrl -> health`` (``up``/``down``/``unknown``) of every active target."""
        return {t["scrapeUrl"]: t["health"] for t in self._api("targets")["activeTargets"]}

    def alerts(self) -> list[dict]:
        """Active alerts (pending and firing), as Prometheus' ``/api/v1/alerts`` lists them."""
        return self._api("alerts")["alerts"]

    def rule_groups(self) -> list[dict]:
        """Loaded rule groups with each rule's health and last error (``/api/v1/rules``)."""
        return self._api("rules")["groups"]

    def wait_for(self, predicate, timeout_s: float, interval_s: float = 1.0) -> bool:
        """Poll ``predicate()`` (errors count as False) until true or ``timeout_s`` seconds pass."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if predicate():
                    return True
            except (PrometheusError, httpx.HTTPError):
                pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(interval_s)
