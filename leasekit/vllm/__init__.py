"""LeaseKitConnector: vLLM's NixlConnector with lease spans, wire-compatible with stock peers.

Load it in vLLM with ``--kv-transfer-config '{"kv_connector": "LeaseKitConnector",
"kv_connector_module_path": "leasekit.vllm.connector", "kv_role": ...}'``. Importing this package
does not import vLLM; ``leasekit.vllm.connector`` does (and checks the release first).
"""

from leasekit.vllm.version import SUPPORTED_VLLM_RELEASES, UnsupportedVllmError, check_vllm_release

CONNECTOR_MODULE_PATH = "leasekit.vllm.connector"
CONNECTOR_NAME = "LeaseKitConnector"
STOCK_CONNECTOR_NAME = "NixlConnector"

__all__ = [
    "CONNECTOR_MODULE_PATH",
    "CONNECTOR_NAME",
    "STOCK_CONNECTOR_NAME",
    "SUPPORTED_VLLM_RELEASES",
    "UnsupportedVllmError",
    "check_vllm_release",
]
