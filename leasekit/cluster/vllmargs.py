"""The vLLM server arguments a pair file may not set (leasekit sets them), and how vLLM's parser reads an
option name. Pure data and a pure function; used by :mod:`leasekit.cluster.pairfile`."""

from __future__ import annotations

LOAD_FORMATS = ("auto", "pt", "safetensors", "npcache", "dummy", "tensorizer", "sharded_state", "gguf",
                "bitsandbytes", "mistral", "runai_streamer", "runai_streamer_sharded", "fastsafetensors")
"""vLLM 0.32's ``--load-format`` choices (``vllm/config/load.py``)."""
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
"""vLLM's ``--dtype`` choices."""
RESERVED_ARGS = {
    "--model": "use model", "--served-model-name": "remove it (leasekit's router asks for its own name)",
    "--load-format": "use load_format", "--dtype": "use dtype", "--tensor-parallel-size": "use tensor_parallel_size",
    "-tp": "use tensor_parallel_size", "--kv-cache-memory-bytes": "use kv_cache_memory_bytes",
    "--gpu-memory-utilization": "use gpu_memory_utilization", "--max-num-seqs": "use max_num_seqs",
    "--max-model-len": "use max_model_len", "--host": "use hosts.<name>.address", "--port": "use http_port",
    "--kv-transfer-config": "use kv_buffer_device (leasekit writes the rest)",
    "--skip-tokenizer-init": "remove it (set for the tiny model only)",
}
"""vLLM arguments leasekit sets itself, and the fix (the pair-file field to use instead)."""
RESERVED_ENV = {
    "CUDA_VISIBLE_DEVICES": "use cuda_visible_devices", "VLLM_CPU_OMP_THREADS_BIND": "use cpus",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "use hosts.<name>.address", "VLLM_NIXL_SIDE_CHANNEL_PORT": "use side_channel_port",
    "LEASEKIT_RUN_DIR": "remove it (leasekit sets it)", "LEASEKIT_FAULT_FILE": "remove it (leasekit sets it)",
}
"""Environment variables leasekit sets itself, and the fix."""


def vllm_flag(arg: str) -> str:
    """The option ``arg`` sets as vLLM's parser reads it (vllm ``utils/argparse_utils.py``
    ``FlexibleArgumentParser``: ``_`` and ``-`` alike in a long option, ``--opt.key`` sets a key of ``--opt``):
    ``"--kv_transfer_config.kv_connector=X"`` -> ``"--kv-transfer-config"``; a short option or a value as is."""
    flag = arg.split("=", 1)[0]
    if not flag.startswith("--"):
        return flag
    return "--" + flag[2:].split(".", 1)[0].replace("_", "-")
