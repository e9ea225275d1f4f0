"""Pair files: a declarative P/D deployment (TOML) — which host runs prefill and decode, on which
device and GPUs, with which model, tensor-parallel size, ports and extra vLLM arguments.

Validated with pydantic like the scenario files: strict types, unknown fields refused, every error
naming the field, the bad value, the allowed values or range and the fix. With no pair file the pair
is the CPU default: the embedded tiny dummy-weight Llama, one core per server. A file must have a
``[prefill]`` and a ``[decode]`` table (empty tables are that default: the minimal file is those
two lines).

Checks that need the host itself (model present, GPU indices, tools) are in
:mod:`leasekit.cluster.preflight`.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from leasekit.cluster.tomlfile import read_toml
from leasekit.cluster.vllmargs import DTYPES, LOAD_FORMATS, RESERVED_ARGS, RESERVED_ENV, vllm_flag

LOCAL = "local"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
VLLM_RELEASE = re.compile(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?")
"""The form of ``vllm_release`` (whole value, ``fullmatch``: no trailing newline): a PEP 440 release as vLLM's
``/version`` reports it, local part dropped."""


class PairFileError(ValueError):
    """A pair file is missing or invalid, or a host refuses it; the message names the file, the
    field (``decode.cuda_visible_devices[1]``), the bad value, what is allowed and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class HostSpec(_Strict):
    """``[hosts.<name>]``: a machine that runs a server.

    ``address``: the IP or hostname the other side reaches it at; ``ssh_port``, ``user``,
    ``identity_file``: how leasekit reaches it over SSH; ``known_hosts``: the known_hosts file its host key
    is checked against (default ``~/.ssh/known_hosts``; an unknown key is refused); ``python``: the interpreter with vLLM and
    leasekit there (default: this interpreter, on this machine only); ``workdir``: run directories'
    root there (default: the run directory on this machine, ``/tmp/leasekit`` elsewhere). A host named
    ``local``, or with a loopback ``address`` and none of the SSH fields, is this machine.
    """

    address: str = Field("127.0.0.1", min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:_-]+$")
    ssh_port: int = Field(22, ge=1, le=65535)
    user: str = Field("root", min_length=1, max_length=64, pattern=r"^[a-z_][a-z0-9_.-]*$")
    identity_file: str | None = Field(None, min_length=1)
    known_hosts: str | None = Field(None, min_length=1)
    python: str | None = Field(None, min_length=1)
    workdir: str | None = Field(None, min_length=1)

    def ssh_configured(self) -> bool:
        """Whether any SSH field was given."""
        return bool(self.model_fields_set & {"ssh_port", "user", "identity_file", "known_hosts"})

    def loopback(self) -> bool:
        """Whether ``address`` is this machine's loopback."""
        if self.address in LOOPBACK:
            return True
        try:
            return ipaddress.ip_address(self.address).is_loopback
        except ValueError:
            return False


class RoleSpec(_Strict):
    """``[prefill]`` / ``[decode]``: one server. See docs/chaos.md, "Pair files and plans"."""

    host: str = Field(LOCAL, min_length=1)
    device: Literal["cpu", "cuda"] = "cpu"
    model: str | None = Field(None, min_length=1)
    allow_download: bool = False
    load_format: Literal[LOAD_FORMATS] | None = None  # type: ignore[valid-type]
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    cuda_visible_devices: list[int] | None = Field(None, min_length=1, max_length=64)
    cpus: list[int] | None = Field(None, min_length=1, max_length=1024)
    http_port: int = Field(0, ge=0, le=65535)
    side_channel_port: int = Field(0, ge=0, le=65535)
    max_num_seqs: int | None = Field(None, ge=1, le=4096)
    max_model_len: int | None = Field(None, ge=16, le=10**7)
    kv_cache_memory_bytes: int | None = Field(None, ge=1 << 20, le=1 << 46)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    kv_buffer_device: Literal["cpu", "cuda"] | None = None
    vllm_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    dtype: Literal[DTYPES] | None = None  # type: ignore[valid-type]

    @property
    def tiny(self) -> bool:
        """Whether this server runs the embedded tiny dummy-weight Llama (no ``model`` given)."""
        return self.model is None

    def model_is_path(self) -> bool:
        """Whether ``model`` is a directory path (absolute, ``~``, ``./`` or ``../``), not a model id."""
        return self.model is not None and self.model.startswith(("/", "~", "./", "../"))

    def problems(self, role: str) -> list[str]:
        """Field-level inconsistencies of this table as ``"<role>.<field>: why; fix: ..."`` lines."""
        out = []
        if self.device == "cuda":
            gpus = self.cuda_visible_devices
            if gpus is None:
                out.append(f"{role}.cuda_visible_devices: required with device = 'cuda' (the GPU indices this server "
                           f"may use, at least tensor_parallel_size = {self.tensor_parallel_size}); fix: e.g. "
                           f"cuda_visible_devices = {list(range(self.tensor_parallel_size))}")
            elif len(gpus) < self.tensor_parallel_size:
                out.append(f"{role}.tensor_parallel_size: {self.tensor_parallel_size} needs as many GPUs, but "
                           f"{role}.cuda_visible_devices = {gpus} lists {len(gpus)}; fix: list more GPUs or lower the TP size")
            if self.cpus is not None:
                out.append(f"{role}.cpus: only for device = 'cpu' (got {self.cpus}); fix: remove it (GPU servers are not pinned)")
        else:
            if self.cuda_visible_devices is not None:
                out.append(f"{role}.cuda_visible_devices: only for device = 'cuda' (got {self.cuda_visible_devices}); "
                           "fix: remove it or set device = 'cuda'")
            if self.gpu_memory_utilization is not None:
                out.append(f"{role}.gpu_memory_utilization: only for device = 'cuda'; fix: use kv_cache_memory_bytes on CPU")
            if self.kv_buffer_device == "cuda":
                out.append(f"{role}.kv_buffer_device: 'cuda' needs device = 'cuda' (got device = 'cpu'); fix: 'cpu' or remove it")
            if self.tensor_parallel_size != 1:
                out.append(f"{role}.tensor_parallel_size: must be 1 with device = 'cpu' (got {self.tensor_parallel_size}; "
                           "a CPU server is pinned to its cores as one process); fix: device = 'cuda' or TP 1")
        for i, gpu in enumerate(self.cuda_visible_devices or []):
            if not 0 <= gpu < 1024:
                out.append(f"{role}.cuda_visible_devices[{i}]: GPU index must satisfy 0 <= index < 1024, got {gpu}")
        if self.cuda_visible_devices and len(set(self.cuda_visible_devices)) != len(self.cuda_visible_devices):
            out.append(f"{role}.cuda_visible_devices: each GPU once, got {self.cuda_visible_devices}")
        for i, cpu in enumerate(self.cpus or []):
            if not 0 <= cpu < 65536:
                out.append(f"{role}.cpus[{i}]: core number must satisfy 0 <= core < 65536, got {cpu}")
        if self.cpus and len(set(self.cpus)) != len(self.cpus):
            out.append(f"{role}.cpus: each core once, got {self.cpus}")
        if self.tiny:
            if self.load_format not in (None, "dummy"):
                out.append(f"{role}.load_format: the embedded tiny model has no weights: only 'dummy' (got "
                           f"{self.load_format!r}); fix: remove it, or set {role}.model to a real model")
            if self.allow_download:
                out.append(f"{role}.allow_download: nothing to download without {role}.model; fix: remove it")
        elif not self.model_is_path() and not _HF_ID.fullmatch(self.model or ""):
            out.append(f"{role}.model: {self.model!r} is neither a path (absolute, '~', './' or '../') nor a Hugging "
                       "Face model id ('org/name'); fix: e.g. model = 'Qwen/Qwen2.5-0.5B-Instruct' or '/models/qwen'")
        if role == "decode" and self.max_num_seqs is not None:
            out.append("decode.max_num_seqs: D's running slots are set by each scenario (topology.decode_max_num_seqs; "
                       "the queued workloads need 1); fix: remove it")
        for i, arg in enumerate(self.vllm_args):
            flag = vllm_flag(arg)
            if flag in RESERVED_ARGS:
                out.append(f"{role}.vllm_args[{i}]: {arg!r} is set by leasekit; fix: {RESERVED_ARGS[flag]}")
        for key in self.env:
            if key in RESERVED_ENV:
                out.append(f"{role}.env.{key}: set by leasekit; fix: {RESERVED_ENV[key]}")
            elif not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
                out.append(f"{role}.env: {key!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        return out


class PairFile(_Strict):
    """A whole pair file: ``lease_duration_s`` (seconds; ``--lease-duration`` overrides it), ``vllm_release``
    (the vLLM release P and D must report on ``GET /version``, else the pair start is refused:
    :mod:`leasekit.cluster.vllmrelease`), ``[hosts.<name>]`` tables and the ``[prefill]`` and ``[decode]`` servers."""

    lease_duration_s: float | None = Field(None, gt=0, le=3600)
    vllm_release: str | None = None

    @field_validator("vllm_release")
    @classmethod
    def _release_form(cls, value: str | None) -> str | None:
        if value is None or VLLM_RELEASE.fullmatch(value):
            return value
        local = f"drop the local part: '{value.split('+', 1)[0]}'" if "+" in value else "e.g. vllm_release = '0.33.0'"
        raise ValueError(f"vllm_release: {value!r} is not a vLLM release; allowed: MAJOR.MINOR.PATCH with an optional "
                         f"PEP 440 pre-release, .post or .dev part ('0.33.0', '0.34.0rc1'); fix: {local}")
    hosts: dict[str, HostSpec] = Field(default_factory=dict)
    prefill: RoleSpec = RoleSpec()
    decode: RoleSpec = RoleSpec()

    @model_validator(mode="after")
    def _consistent(self) -> "PairFile":
        problems = []
        for name, host in self.hosts.items():
            if not re.match(r"^[a-z0-9][a-z0-9-]*$", name):
                problems.append(f"hosts.{name}: host names are [a-z0-9-] starting with a letter or digit")
            if name == LOCAL and host.ssh_configured():
                problems.append(f"hosts.{LOCAL}: this machine is not reached over SSH; fix: remove ssh_port/user/"
                                "identity_file, or give the host another name")
            if name != LOCAL and "address" not in host.model_fields_set:
                problems.append(f"hosts.{name}.address: required (the IP or hostname the other server and leasekit reach "
                                f"it at); fix: e.g. address = '10.0.0.12', or address = '127.0.0.1' for this machine")
            if not self.is_local(name) and host.python is None:
                problems.append(f"hosts.{name}.python: required for a remote host (the interpreter with vLLM and "
                                "leasekit there); fix: e.g. python = '/opt/leasekit/.venv/bin/python'")
        for role in ("prefill", "decode"):
            spec: RoleSpec = getattr(self, role)
            if spec.host != LOCAL and spec.host not in self.hosts:
                problems.append(f"{role}.host: {spec.host!r} is not a [hosts] table (have: "
                                f"{', '.join(sorted({LOCAL, *self.hosts}))}); fix: add [hosts.{spec.host}] or use one of those")
            if spec.model_is_path() and not self.is_local(spec.host) and not spec.model.startswith("/"):
                problems.append(f"{role}.model: a path on remote host {spec.host!r} must be absolute, got {spec.model!r}")
            problems.extend(spec.problems(role))
        problems.extend(self._pair_problems())
        problems.extend(self._reach_problems())
        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    def _pair_problems(self) -> list[str]:
        p, d = self.prefill, self.decode
        out = []
        if p.tiny != d.tiny or (not p.model_is_path() and not d.model_is_path() and p.model != d.model):
            out.append(f"decode.model: P and D must serve the same model (D reads P's KV blocks), got prefill.model = "
                       f"{p.model or '(tiny)'!r} and decode.model = {d.model or '(tiny)'!r}; fix: give both the same model")
        dtypes = [spec.dtype or ("float32" if spec.tiny else "auto") for spec in (p, d)]  # unset: what the server gets
        if dtypes[0] != dtypes[1]:
            out.append(f"decode.dtype: P and D must use the same dtype (the KV layout), got prefill.dtype = {dtypes[0]!r} "
                       f"and decode.dtype = {dtypes[1]!r}; fix: give both the same dtype (or leave both out)")
        for role, spec in (("prefill", p), ("decode", d)):
            if spec.http_port and spec.http_port == spec.side_channel_port:
                out.append(f"{role}.side_channel_port: {spec.side_channel_port} is also {role}.http_port; fix: another port")
        if self.host_key(p.host) == self.host_key(d.host):
            ports = ("http_port", "side_channel_port")
            for d_port in ports:
                for p_port in ports:
                    if getattr(p, p_port) and getattr(p, p_port) == getattr(d, d_port):
                        out.append(f"decode.{d_port}: {getattr(d, d_port)} is also prefill.{p_port} on the same host "
                                   f"({d.host!r}); fix: another port (or 0: a free one picked at start)")
            if p.model_is_path() and d.model_is_path() and p.model != d.model:
                out.append(f"decode.model: P and D on the same host must load the same model directory (D reads P's KV "
                           f"blocks), got prefill.model = {p.model!r} and decode.model = {d.model!r}; fix: the same path for both")
            shared = sorted(set(p.cuda_visible_devices or []) & set(d.cuda_visible_devices or []))
            if shared and (p.gpu_memory_utilization or 0.9) + (d.gpu_memory_utilization or 0.9) > 1.0:
                out.append(f"decode.gpu_memory_utilization: P and D share GPU(s) {shared} on host {d.host!r}, so their "
                           "gpu_memory_utilization must sum to <= 1 (vLLM's default is 0.9 each); fix: e.g. 0.45 on both")
            if set(p.cpus or []) & set(d.cpus or []):
                out.append(f"decode.cpus: shares cores {sorted(set(p.cpus) & set(d.cpus))} with prefill.cpus on the same "
                           "host (NIXL's progress thread spins a core: a shared core starves the other server); fix: disjoint cores")
        return out

    def _reach_problems(self) -> list[str]:
        """P and D must reach each other: a server on this machine listens on loopback only (unless
        this machine's host has another ``address``), so it cannot pair with one on another host."""
        local = [r for r in ("prefill", "decode") if self.is_local(self.role(r).host)]
        if len(local) != 1:
            return []
        here, there = local[0], "decode" if local[0] == "prefill" else "prefill"
        here_host, there_host = self.role(here).host, self.role(there).host
        if not self.host(here_host).loopback() or self.host(there_host).loopback():
            return []  # this machine has an address the other reaches, or the other host is this machine too
        return [f"{here}.host: {here} runs on this machine ({here_host!r}, listening on 127.0.0.1 only) and {there} on "
                f"host {there_host!r} ({self.host(there_host).address}): they could not reach each other; fix: put both "
                f"on [hosts] reachable from each other, or give this machine an address {there_host!r} reaches "
                f"([hosts.{here_host}] address = '...')"]

    def host(self, name: str) -> HostSpec:
        """The host called ``name`` (``local`` is this machine even when not declared)."""
        return self.hosts.get(name, HostSpec())

    def is_local(self, name: str) -> bool:
        """Whether host ``name`` is this machine: named ``local``, or a loopback address with no SSH field."""
        host = self.host(name)
        return name == LOCAL or (host.loopback() and not host.ssh_configured())

    def host_key(self, name: str) -> str:
        """A name for the machine behind host ``name`` (every local host is ``local``)."""
        return LOCAL if self.is_local(name) else name

    def role(self, role: str) -> RoleSpec:
        """The ``prefill`` or ``decode`` table.

        Raises:
            ValueError: another role.
        """
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        return getattr(self, role)

    def python(self, role: str) -> str:
        """The interpreter the server of ``role`` runs under on its host."""
        return self.host(self.role(role).host).python or sys.executable

    def remote_roles(self) -> list[str]:
        """Roles whose host is not this machine."""
        return [r for r in ("prefill", "decode") if not self.is_local(self.role(r).host)]


def _format_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid pair file {source}:"]
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"] if part != "")
        if err["type"] == "value_error":  # our cross-field checks: already "field: why; fix"
            lines.extend(f"  {line.strip()}" for line in str(err["ctx"]["error"]).split("\n  "))
            continue
        message = err["msg"]
        if err["type"] != "missing" and not isinstance(err.get("input"), (dict, list)):
            message += f" (got {err.get('input')!r})"
        if err["type"] == "extra_forbidden":
            message += "; fix: remove it or check the spelling (docs/chaos.md lists every field)"
        else:
            field = str(err["loc"][-1]) if err["loc"] else ""
            message += f"; fix: {_FIXES.get(field, _FIX_DEFAULT)}"
        lines.append(f"  {_indexed(loc) or '(top level)'}: {message}")
    return "\n".join(lines)


_FIXES = {
    "device": "device = 'cpu' or device = 'cuda'",
    "http_port": "a port from 1 to 65535, or 0 for a free one picked at start",
    "side_channel_port": "a port from 1 to 65535, or 0 for a free one picked at start",
    "ssh_port": "the host's SSH port, 1 to 65535 (default 22)",
    "lease_duration_s": "seconds with 0 < L <= 3600, or leave it out (each scenario's lease, or --lease-duration)",
    "vllm_release": "a quoted release, e.g. vllm_release = '0.33.0', or leave it out",
    "dtype": f"one of {', '.join(DTYPES)}",
    "load_format": "one of the values listed, or leave it out",
    "tensor_parallel_size": "1 to 64, at most the GPUs in cuda_visible_devices",
    "gpu_memory_utilization": "a share with 0 < u <= 1",
    "kv_buffer_device": "'cpu' or 'cuda' (cuda needs device = 'cuda')",
}
"""The fix given with a field's type or range error, by field name."""
_FIX_DEFAULT = "a value as stated (docs/chaos.md, 'Pair files and plans', lists every field)"


def _indexed(loc: str) -> str:
    """``decode.cuda_visible_devices.1`` -> ``decode.cuda_visible_devices[1]``."""
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", loc)


def parse_pair_file(data: dict, source: str = "<pair file>", base_dir: Path | None = None) -> PairFile:
    """Validate a pair file already parsed from TOML. Local model paths starting ``./``, ``../`` or
    ``~`` are made absolute (relative to ``base_dir``, default the working directory).

    Raises:
        PairFileError: validation failed (the message lists every bad field).
    """
    try:
        pair = PairFile.model_validate(data)
    except ValidationError as exc:
        raise PairFileError(_format_error(exc, source)) from None
    updates = {}
    for role in ("prefill", "decode"):
        spec = pair.role(role)
        if spec.model_is_path() and pair.is_local(spec.host) and not spec.model.startswith("/"):
            path = Path(os.path.expanduser(spec.model))
            updates[role] = spec.model_copy(update={"model": str((base_dir or Path.cwd()) / path if not path.is_absolute() else path)})
    return pair.model_copy(update=updates) if updates else pair


def load_pair_file(path: str | os.PathLike[str]) -> PairFile:
    """Load and validate one pair file (TOML).

    Raises:
        PairFileError: the file is missing, not UTF-8 TOML, lacks a ``[prefill]`` or ``[decode]`` table
            (an empty file included), or fails validation.
    """
    path = Path(path)
    data = read_toml(path, "pair file", PairFileError, not_found_hint=" (examples: pairs/*.toml)")
    missing = [table for table in ("prefill", "decode") if table not in data]
    need = (f"(top level): no {' and no '.join(f'[{t}]' for t in missing)} table: a pair file needs a [prefill] and a "
            "[decode] table (empty ones are the CPU default servers; the minimal file is the two lines [prefill] and "
            f"[decode]; examples: pairs/*.toml); fix: add {' and '.join(f'[{t}]' for t in missing)}")
    try:
        pair = parse_pair_file(data, str(path), path.resolve().parent)
    except PairFileError as exc:
        raise PairFileError(f"{exc}\n  {need}" if missing else str(exc)) from None
    if missing:
        raise PairFileError(f"invalid pair file {path}:\n  {need}")
    return pair

