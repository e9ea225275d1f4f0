"""From a pair file to servers: the :class:`leasekit.cluster.serverspec.ServerSpec` fields of each role,
merged over what :class:`leasekit.cluster.pair.PDPair` builds, and the check that every server can be
started from here."""

from __future__ import annotations

from leasekit.cluster.pairfile import PairFile, PairFileError

DECODE_MAX_MODEL_LEN = 16_384
"""``--max-model-len`` of D when it runs the tiny model and nothing else is said (P keeps 4096; NIXL's
compatibility hash does not include it, vLLM ``nixl/metadata.py``): room for a slot-holding request
that outlasts an L = 30 run (:func:`leasekit.chaos.workload.holder_tokens`). The tiny model's 64 MiB
KV cache holds 65 536 tokens."""


TINY_KV_CACHE_BYTES = 64 * 1024 * 1024
"""The CPU default's KV cache (``ServerSpec.kv_cache_bytes``), 64 MiB."""


def server_fields(pair: PairFile, role: str) -> dict:
    """:class:`leasekit.cluster.serverspec.ServerSpec` keyword arguments for the server of ``role`` as
    ``pair`` describes it. Keys always present: ``device``, ``load_format``, ``skip_tokenizer_init``,
    ``dtype``, ``kv_cache_bytes``, ``gpu_memory_utilization``, ``tensor_parallel_size``,
    ``cuda_visible_devices``, ``kv_buffer_device``, ``extra_args``, ``extra_env``; and only when the
    file sets them: ``model_dir`` (a real model: its path or Hugging Face id), ``max_model_len``,
    ``max_num_seqs`` (P), ``cpu`` (a core or tuple of cores; None on a GPU), ``http_port``,
    ``side_channel_port``, and ``bind_host``/``url_host``/``side_channel_host`` (a host whose address
    is not loopback listens on 0.0.0.0 and is reached at its address). The CPU default (no file) gives
    exactly the ``ServerSpec`` defaults, except D's ``max_model_len``: ``DECODE_MAX_MODEL_LEN`` for the
    tiny model.

    A Hugging Face id without ``allow_download`` runs with ``HF_HUB_OFFLINE=1``: resolved from the
    host's Hugging Face cache only, never downloaded.

    Raises:
        ValueError: ``role`` is not ``prefill`` or ``decode``.
    """
    spec = pair.role(role)
    fields: dict = {
        "device": spec.device,
        "load_format": spec.load_format or ("dummy" if spec.tiny else "auto"),
        "skip_tokenizer_init": spec.tiny,
        "dtype": spec.dtype or ("float32" if spec.tiny else None),
        "kv_cache_bytes": spec.kv_cache_memory_bytes or (TINY_KV_CACHE_BYTES if spec.device == "cpu" else None),
        "gpu_memory_utilization": spec.gpu_memory_utilization,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "cuda_visible_devices": list(spec.cuda_visible_devices) if spec.cuda_visible_devices else None,
        "kv_buffer_device": spec.kv_buffer_device,
        "extra_args": list(spec.vllm_args),
        "extra_env": dict(spec.env),
    }
    if not spec.tiny:
        fields["model_dir"] = spec.model
        if not spec.model_is_path() and not spec.allow_download:
            fields["extra_env"].setdefault("HF_HUB_OFFLINE", "1")
    if spec.max_model_len is not None:
        fields["max_model_len"] = spec.max_model_len
    elif spec.tiny and role == "decode":
        fields["max_model_len"] = DECODE_MAX_MODEL_LEN
    if spec.max_num_seqs is not None:
        fields["max_num_seqs"] = spec.max_num_seqs
    if spec.device == "cuda":
        fields["cpu"] = None
    elif spec.cpus:
        fields["cpu"] = spec.cpus[0] if len(spec.cpus) == 1 else tuple(spec.cpus)
    for port in ("http_port", "side_channel_port"):
        if getattr(spec, port):
            fields[port] = getattr(spec, port)
    host = pair.host(spec.host)
    if not host.loopback():
        fields.update(bind_host="0.0.0.0", url_host=host.address, side_channel_host=host.address)
    return fields


def require_local(pair: PairFile) -> None:
    """Refuse a deployment with a server on another machine unless SSH host support is installed
    (``leasekit.cluster.remote`` with a ``server_on_host`` function).

    Raises:
        PairFileError: naming the role, its host and the fix.
    """
    remote = pair.remote_roles()
    if not remote:
        return
    try:
        from leasekit.cluster import remote as ssh_support  # noqa: PLC0415 - optional, SSH host support
    except ImportError:
        ssh_support = None
    if ssh_support is not None and callable(getattr(ssh_support, "server_on_host", None)):
        return
    role = remote[0]
    name = pair.role(role).host
    host = pair.host(name)
    raise PairFileError(
        f"{role}.host = {name!r} is another machine ({host.user}@{host.address}:{host.ssh_port}): starting servers "
        "there needs SSH host support (leasekit.cluster.remote.server_on_host), not available in this installation; fix: run "
        "leasekit on that machine with a local pair file, or see what a run would do with `leasekit chaos run --pair FILE --plan`")


def merged_server_kwargs(base: dict, pair: PairFile, role: str, *, keep: set[str] = frozenset()) -> dict:
    """``base`` (the ``ServerSpec`` keyword arguments a pair builds for ``role``) with the deployment's
    :func:`server_fields` laid over it, except for the keys in ``keep`` (what the caller fixed: ports
    of a restart on the same address, a scenario's KV cache size, a network namespace's hosts).
    ``extra_env`` is combined with ``base``'s winning (launch conditions: faketime, fault files);
    ``extra_args`` are ``base``'s then the file's ``vllm_args``.

    Raises:
        ValueError: ``role`` is not ``prefill`` or ``decode``.
    """
    fields = server_fields(pair, role)
    merged = dict(base)
    merged["extra_env"] = {**fields.pop("extra_env"), **base.get("extra_env", {})}
    merged["extra_args"] = [*base.get("extra_args", []), *fields.pop("extra_args")]
    merged.update({key: value for key, value in fields.items() if key not in keep})
    return merged
