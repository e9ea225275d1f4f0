"""A P/D pair: one prefill and one decode server on this host, pinned to separate cores, warmed up
with one routed request (the first P->D request does the NIXL handshake), torn down on exit, on
Ctrl-C and on test failure (context manager + ``atexit``).
"""

from __future__ import annotations

import atexit
import logging
import random
import sys
import threading
import time
import weakref
from pathlib import Path

from leasekit.cluster.deploy import DECODE_MAX_MODEL_LEN, merged_server_kwargs, require_local
from leasekit.cluster.model import VOCAB_SIZE, write_tiny_llama
from leasekit.cluster.pairspec import PairSpec  # noqa: F401 - re-exported (the spec lives in pairspec)
from leasekit.cluster.router import Router, RoutedResult
from leasekit.cluster.server import ServerStartTimeout, VllmServer
from leasekit.cluster.serverspec import ServerSpec
from leasekit.cluster.testbed import PlannedTestbed, Testbed
from leasekit.cluster.vllmrelease import UNKNOWN_RELEASE, measure_pair

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
"""The testbed hosts of a pair started with ``network_namespace``: P runs on ``prefill``, D on ``decode``."""

_LIVE: "weakref.WeakSet[VllmServer]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def _stop_all_servers() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:
        try:
            server.stop(grace_s=3)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


atexit.register(_stop_all_servers)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    """A prompt of ``length`` random token ids (3 .. vocab-1; avoids BOS/EOS ids)."""
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


class WarmUpError(RuntimeError):
    """The pair started but no request made it P -> D; the message names the failing side."""


class PDPair:
    """Start, warm up, use and tear down a P/D pair.

    Args:
        spec: what to start (``spec.deployment``: the pair file's servers; one on another machine without
            SSH host support raises :class:`leasekit.cluster.pairfile.PairFileError`).
        run_dir: where logs, the model config and span files go (created).
        start_timeout_s: how long each server may take to become healthy.
    """

    _dry, _dry_testbed = False, None  # a pair made by planned(): nothing created, written or started

    def __init__(self, spec: PairSpec, run_dir: str | Path, *, start_timeout_s: float = 300.0):
        self.spec = spec
        self.deployment = spec.deployment
        if self.deployment is not None and not self._dry:
            require_local(self.deployment)
        self.run_dir = Path(run_dir).resolve()
        if not self._dry:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.model_dir = self.run_dir / "model" if self._dry else write_tiny_llama(self.run_dir / "model")
        self.start_timeout_s = start_timeout_s
        self.testbed: Testbed | PlannedTestbed | None = None
        separate = self.deployment is not None and len({self.deployment.host_key(self.deployment.role(r).host)
                                                         for r in ROLES} - {"local"}) == 2
        if spec.network_namespace and not separate and self.deployment is not None and self.deployment.remote_roles():
            from leasekit.cluster.pairfile import PairFileError

            hosts = {r: self.deployment.role(r).host for r in ROLES}
            raise PairFileError(
                f"a partition cuts the network between P's host and D's host, but this pair file runs P on {hosts['prefill']!r} "
                f"and D on {hosts['decode']!r}, not on two separate hosts with another machine among them (a namespace made here "
                "cannot hold a server started over SSH); fix: put [prefill] and [decode] on two different SSH hosts, or both on "
                "this machine (leasekit then makes the two hosts itself)")
        if spec.network_namespace and not separate:  # P and D on two hosts: a network namespace each, on one bridge
            # (a pair file whose P and D are on two other hosts already has them apart: no namespaces made)
            self.testbed = (self._dry_testbed or PlannedTestbed(ROLES)) if self._dry else Testbed(ROLES)
        self.logging_config: Path | None = None
        if spec.lease_logging:
            from leasekit.telemetry.vllm_logconfig import write_logging_config

            path = self.run_dir / "vllm-logging.json"
            self.logging_config = path if self._dry else write_logging_config(path)
        self.prefill = self._server("prefill", "prefill", spec.prefill_connector, spec.prefill_cpu, max_num_seqs=8)
        self.decode = self._server("decode", "decode", spec.decode_connector, spec.decode_cpu, max_num_seqs=spec.decode_max_num_seqs)
        self.router: Router | None = None
        self.rng = random.Random(0)
        self.startup_s: dict[str, float] = {}
        self.start_retries: list[str] = []
        self.vllm_releases: dict[str, str] = {}  # role -> the release its GET /version reported, once healthy
        self.vllm_release = UNKNOWN_RELEASE  # both as one string (leasekit.cluster.vllmrelease.pair_label)

    @classmethod
    def planned(cls, spec: PairSpec, run_dir: str | Path, *, testbed=None) -> "PDPair":
        """The pair a run would build, for ``leasekit chaos run --plan``: its servers' ``command()`` and
        ``launch_environment()`` are the run's own, but nothing is created, written or started (no run
        directory, model file, namespace, clock shim). ``testbed``: a stand-in for the two hosts of a spec
        that asks for a network namespace (default :class:`leasekit.cluster.testbed.PlannedTestbed`)."""
        pair = cls.__new__(cls)
        pair._dry, pair._dry_testbed = True, testbed
        cls.__init__(pair, spec, run_dir)
        return pair

    def _launch(self, role: str) -> tuple[list[str], dict[str, str], str, str]:
        """Command prefix, extra env, bind host and URL host for one side's launch conditions."""
        spec = self.spec
        prefix: list[str] = []
        env: dict[str, str] = {}
        bind_host = url_host = "127.0.0.1"
        if self.testbed is not None:  # on its own host: listens on every address, reached at the host's
            prefix += self.testbed.exec_prefix(role)
            bind_host, url_host = "0.0.0.0", self.testbed.address(role)
            # one machine underneath: UCX would read KV blocks by cross-memory attach (process_vm_readv) and
            # never touch the network; hosts share no memory, so no shared-memory transport (KV data over TCP)
            env["UCX_TLS"] = "^sm"
        offset = spec.prefill_monotonic_offset_s if role == "prefill" else spec.decode_monotonic_offset_s
        if offset:
            from leasekit.cluster.clockshift import time_namespace_prefix

            prefix += time_namespace_prefix(offset, check=not self._dry)
        wall_offset, wall_rate = (
            (spec.prefill_wall_offset_s, spec.prefill_wall_rate) if role == "prefill" else (spec.decode_wall_offset_s, spec.decode_wall_rate)
        )
        if wall_offset or wall_rate != 1.0:
            from leasekit.cluster.clockshift import faketime_env

            env.update(faketime_env(wall_offset, wall_rate, build=not self._dry))
        if spec.fault_files:
            env["LEASEKIT_FAULT_FILE"] = str(self.fault_file(role))
        if self.logging_config is not None:
            env["VLLM_LOGGING_CONFIG_PATH"] = str(self.logging_config)
        if spec.otlp_traces_endpoint:
            env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
        return prefix, env, bind_host, url_host

    def fault_file(self, role: str) -> Path:
        """The connector fault-control file of ``role`` (``prefill`` or ``decode``)."""
        return self.run_dir / "faults" / f"{role}.json"

    def _server(self, name: str, role: str, connector: str, cpu, *, max_num_seqs: int, http_port: int = 0, side_channel_port: int = 0) -> VllmServer:
        prefix, env, bind_host, url_host = self._launch(role)
        deployment_free = self.deployment is None
        kwargs = dict(
            name=name, role=role, connector=connector, model_dir=self.model_dir, lease_duration_s=self.spec.lease_duration_s,
            cpu=cpu, max_num_seqs=max_num_seqs, http_port=http_port, side_channel_port=side_channel_port, extra_env=env,
            extra_args=["--otlp-traces-endpoint", self.spec.otlp_traces_endpoint] if self.spec.otlp_traces_endpoint else [],
            command_prefix=prefix, bind_host=bind_host, url_host=url_host, connector_extra=self._connector_extra(role),
            **({"side_channel_host": url_host} if self.testbed is not None else {}),  # NIXL between the two hosts
            kv_load_failure_policy=self.spec.decode_kv_load_failure_policy if role == "decode" else None,
            transfer_mode=self.spec.transfer_mode,
            **({"kv_cache_bytes": self.spec.prefill_kv_cache_bytes} if role == "prefill" and self.spec.prefill_kv_cache_bytes else {}),
            **({"max_model_len": DECODE_MAX_MODEL_LEN} if role == "decode" and deployment_free else {}),  # a pair file: deploy.server_fields
        )
        python, deployment = sys.executable, self.deployment
        if deployment is not None:  # the pair file's server, under this pair's launch conditions
            keep = {key for key in ("http_port", "side_channel_port", "kv_cache_bytes") if kwargs.get(key)}
            keep |= {"bind_host", "url_host", "side_channel_host"} if self.testbed is not None else set()
            kwargs, python = merged_server_kwargs(kwargs, deployment, role, keep=keep), deployment.python(role)
        spec = ServerSpec(**kwargs)
        if deployment is not None and role in deployment.remote_roles() and not self._dry:
            from leasekit.cluster.remote import server_on_host  # SSH host support; require_local() checked it is there

            server = server_on_host(deployment, role, spec, self.run_dir)
        else:
            server = VllmServer(spec, self.run_dir, python=python)
        if not self._dry:
            with _LIVE_LOCK:
                _LIVE.add(server)
        return server

    def _connector_extra(self, role: str) -> dict[str, object]:
        extra: dict[str, object] = {}
        if role == "prefill" and self.spec.prefill_max_hold_s is not None:
            extra["leasekit_max_hold_s"] = self.spec.prefill_max_hold_s
        if role == "prefill" and not self.spec.fail_closed and self.spec.prefill_connector == "leasekit":
            extra["leasekit_fail_closed"] = False
        if role == "prefill" and self.spec.prefill_pledge_s is not None:
            extra["leasekit_pledge_s"] = self.spec.prefill_pledge_s
        return extra

    # -- lifecycle -------------------------------------------------------------------------
    def launch(self, *, idle: bool = False) -> "PDPair":
        """Launch both servers and return at once; ``idle``: as background spares (``SCHED_BATCH``, nice 10; they
        warm up in spare CPU time; :meth:`start` promotes them). Returns self."""
        try:
            self.prefill.start(idle=idle)
            self.decode.start(idle=idle)
        except BaseException:
            self.stop()
            raise
        return self

    def start(self) -> "PDPair":
        """Start both servers (concurrently; or promote a pair :meth:`launch`-ed idle), wait for
        health, warm up; returns self.

        Once both are healthy, each server's vLLM release is read from ``GET /version`` into
        :attr:`vllm_releases` and :attr:`vllm_release` ("unknown" where unreadable).

        Raises:
            ServerStartError / WarmUpError: with the server log tail; both servers are stopped first.
            leasekit.cluster.vllmrelease.VllmReleaseMismatch: a server reports another release than the pair
                file's ``vllm_release`` (both servers are stopped first).
        """
        try:
            if self.prefill.proc is None:
                self.prefill.start()
                self.decode.start()
            self.prefill.promote()
            self.decode.promote()
            self.startup_s["prefill"] = self._wait_healthy_or_restart("prefill")
            self.startup_s["decode"] = self._wait_healthy_or_restart("decode")
            self.vllm_releases, self.vllm_release = measure_pair(self)
            self.router = Router(self.prefill.url, self.decode.url)
            if self.spec.warm_up:
                self.warm_up()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy_or_restart(self, role: str) -> float:
        """Wait for the starting server of ``role`` (``prefill`` or ``decode``); returns its startup
        seconds. One that is alive but not healthy after ``start_timeout_s`` (a start stuck or
        starved, seen once in CI at 300 s where 10-60 s is usual) is stopped and started once more
        on fresh ports, its log kept as ``<role>-start-timeout.log`` and the diagnosis logged at
        WARNING and kept in :attr:`start_retries`.

        Raises:
            ServerStartError: it exited, or the second start timed out too (with its diagnosis).
        """
        server: VllmServer = getattr(self, role)
        try:  # after another server's restart, this one's window restarts too (it shared the CPU)
            return server.wait_healthy(self.start_timeout_s, from_now=bool(self.start_retries))
        except ServerStartTimeout as exc:
            why = str(exc)
        server.stop(grace_s=2)
        kept = server.log_path.with_name(f"{role}-start-timeout.log")
        server.log_path.rename(kept)
        stacks, kept_stacks = (server.log_path.with_name(f"{stem}.stacks.txt") for stem in (role, f"{role}-start-timeout"))
        if stacks.exists():
            stacks.rename(kept_stacks)
        why = why.replace(str(server.log_path), str(kept)).replace(str(stacks), str(kept_stacks))
        logger.warning("%s did not start in %.0f s; starting it once more. %s", role, self.start_timeout_s, why)
        self.start_retries.append(f"{role}: {why}")
        fresh = self._server(role, role, server.spec.connector, server.spec.cpu, max_num_seqs=server.spec.max_num_seqs)
        setattr(self, role, fresh)
        fresh.start()
        return fresh.wait_healthy(self.start_timeout_s)

    def warm_up(self, attempts: int = 3) -> RoutedResult:
        """Route one request so D handshakes with P, then re-pin every thread.

        Raises:
            WarmUpError: no attempt returned tokens from D.
        """
        assert self.router is not None
        last: RoutedResult | None = None
        for _ in range(attempts):
            last = self.router.generate(self.prompt(), max_tokens=2)
            if last.decode is not None and last.decode.ok:
                self.prefill.pin()
                self.decode.pin()
                return last
            time.sleep(1.0)
        detail = last.prefill.error if last and not last.prefill.ok else (last.decode.error if last and last.decode else "?")
        raise WarmUpError(
            f"warm-up request failed {attempts} times ({detail}); P log {self.prefill.log_path}, "
            f"D log {self.decode.log_path}"
        )

    def spare_decode(self) -> VllmServer:
        """Launch a second D like the current one (its own new ports) in the background, to
        replace D after a scenario kills it (see :meth:`adopt_decode`); returns it, not started
        serving (about 45 s of imports on this class of machine)."""
        old = self.decode
        if self.deployment is not None and (self.deployment.decode.http_port or self.deployment.decode.side_channel_port):
            raise RuntimeError("no spare D: the running D holds the ports the pair file fixes for D; D restarts in place")
        spare = self._server("decode", "decode", old.spec.connector, old.spec.cpu, max_num_seqs=old.spec.max_num_seqs)
        spare.log_path = old.log_path.with_name(f"decode-spare-{int(time.time())}.log")
        spare.start(idle=True)
        return spare

    def adopt_decode(self, spare: VllmServer, *, warm_up: bool = True) -> VllmServer:
        """Make ``spare`` (from :meth:`spare_decode`) this pair's D: stop the old D, promote the
        spare, wait for health, re-point the router, warm up.

        Raises:
            ServerStartError / WarmUpError: the spare did not come up (it is stopped).
        """
        self.decode.stop(grace_s=5)
        self.decode = spare
        try:
            spare.promote()
            self.startup_s["decode_restart"] = spare.wait_healthy(self.start_timeout_s)
        except BaseException:
            spare.stop(grace_s=2)
            raise
        return self._route_to_new_decode(warm_up)

    def _route_to_new_decode(self, warm_up: bool) -> VllmServer:
        """Read the new D's release (P's is kept; an unreadable D keeps the release known before), point
        the router at the current D and, if asked, warm the pair up; returns D.

        Raises:
            leasekit.cluster.vllmrelease.VllmReleaseMismatch: as in :meth:`start`.
        """
        self.vllm_releases, self.vllm_release = measure_pair(self, roles=("decode",))
        if self.router is not None:
            self.router.close()
        self.router = Router(self.prefill.url, self.decode.url)
        if warm_up:
            self.warm_up()
        return self.decode

    def restart_decode(self, connector: str | None = None, *, same_address: bool = True, warm_up: bool = True) -> VllmServer:
        """Stop D and start a new D (new engine id), on the same ports unless told otherwise.

        Returns the new server after it is healthy (and warmed up unless ``warm_up`` is False).
        """
        old = self.decode
        old.stop(grace_s=5)
        self.decode = self._server(
            "decode",
            "decode",
            connector or old.spec.connector,
            old.spec.cpu,
            max_num_seqs=old.spec.max_num_seqs,
            http_port=old.http_port if same_address else 0,
            side_channel_port=old.side_channel_port if same_address else 0,
        )
        self.decode.log_path = old.log_path.with_name(f"decode-{int(time.time())}.log")
        self.decode.start()
        self.startup_s["decode_restart"] = self.decode.wait_healthy(self.start_timeout_s)
        return self._route_to_new_decode(warm_up)

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop both servers together (SIGTERM, SIGKILL after ``grace_s`` seconds), then remove the
        testbed (the two hosts) if any; idempotent."""
        if self.router is not None:
            self.router.close()
        for server in (self.decode, self.prefill):
            server.begin_stop()
        for server in (self.decode, self.prefill):
            server.stop(grace_s=grace_s)
        if self.testbed is not None:
            self.testbed.destroy()

    def __enter__(self) -> "PDPair":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- helpers ---------------------------------------------------------------------------
    def prompt(self, length: int = 48) -> list[int]:
        """A fresh random prompt (distinct prompts avoid prefix-cache hits on D)."""
        return random_prompt(self.rng, length)

    @property
    def span_dir(self) -> Path:
        """Where LeaseKitConnector workers of this pair write span files."""
        return self.run_dir / "spans"
