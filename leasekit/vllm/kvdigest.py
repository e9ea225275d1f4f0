"""A digest of KV blocks as they sit in a worker's KV cache: chaos-testing evidence only.

With fault points enabled (``LEASEKIT_FAULT_FILE``; never in production), P records the digest of a
lease's blocks at grant (on its ``kv_lease`` span) and D the digest of the blocks it read, before the read
gate decides (on its ``kv_lease_read`` span). Equal digests: D received P's KV; different: the blocks
changed between grant and read (freed and reused), which the read gate must discard.

The layout is vLLM's NIXL registration (vllm 0.32.0 ``nixl/base_worker.py`` ``_build_fa_local``): block
``b`` of region ``i`` is ``block_len_per_layer[i]`` bytes at ``base[i] + b * block_stride_per_layer[i]``.
Host memory only (the CPU platform); on any other device, or with a layout it does not know, it returns
None rather than touching device memory.
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any, Sequence

KV_DIGEST_ATTR = "leasekit.kv_digest"
"""Span attribute holding the digest (16 hex characters of SHA-256)."""


def kv_digest(worker: Any, block_ids: Sequence[int]) -> str | None:
    """SHA-256 (first 16 hex chars) over every registered region's bytes of ``block_ids``, in order.

    Args:
        worker: vLLM's NIXL worker (``device_type``, ``engine_id``, ``tp_rank``, ``kv_caches_base_addr``,
            ``block_len_per_layer``, ``block_stride_per_layer``, ``_transfer_layer_region_indices``).
        block_ids: local block ids (KV cache group 0).

    Returns:
        The digest, or None off the CPU platform, with no blocks, or with an unknown layout.
    """
    if getattr(worker, "device_type", None) != "cpu" or not block_ids:
        return None
    try:
        bases = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
        regions = worker._transfer_layer_region_indices or range(len(bases))
        digest = hashlib.sha256()
        for i in regions:
            length, stride = int(worker.block_len_per_layer[i]), int(worker.block_stride_per_layer[i])
            for block in block_ids:
                digest.update(ctypes.string_at(int(bases[i]) + int(block) * stride, length))
        return digest.hexdigest()[:16]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
