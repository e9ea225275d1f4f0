"""LeaseKitConnector: vLLM's NixlConnector with lease spans, wire-compatible with stock peers.

Load it in vLLM with ``--kv-transfer-config '{"kv_connector": "LeaseKitConnector",
"kv_connector_module_path": "leasekit.vllm.connector", "kv_role": ...}'``. Importing this package
does not import vLLM; ``leasekit.vllm.connector`` does (and checks the release first).
"""

from leasekit.vllm.version import SUPPORTED_VLLM_RELEASES, UnsupportedVllmError, check_vllm_release

from leasekit.lease.config import CONNECTOR_MODULE as CONNECTOR_MODULE_PATH  # noqa: E402 - one definition
CONNECTOR_NAME = "LeaseKitConnector"
STOCK_CONNECTOR_NAME = "NixlConnector"
PUSH_CONNECTOR_NAME = "LeaseKitPushConnector"
"""LeaseKit's push-mode connector (:mod:`leasekit.vllm.push`), loaded from :data:`CONNECTOR_MODULE_PATH` too."""
STOCK_PUSH_CONNECTOR_NAME = "NixlPushConnector"
"""vLLM's push-mode (WRITE) NIXL connector (vllm ``nixl/connector.py``)."""
TRANSFER_MODES = ("pull", "push")
"""NIXL transfer modes: ``pull`` (D READs P's KV blocks) and ``push`` (P WRITEs them into D's)."""

__all__ = [
    "CONNECTOR_MODULE_PATH",
    "CONNECTOR_NAME",
    "PUSH_CONNECTOR_NAME",
    "STOCK_CONNECTOR_NAME",
    "STOCK_PUSH_CONNECTOR_NAME",
    "TRANSFER_MODES",
    "SUPPORTED_VLLM_RELEASES",
    "UnsupportedVllmError",
    "check_vllm_release",
]
