"""leasekit: observability and chaos testing for the KV-cache lease of vLLM's NixlConnector.

See docs/lease-model.md for the mechanism, the bounds and the invariants. Data flows one way:
``leasekit.vllm`` / ``leasekit.sim`` emit lease events -> ``leasekit.telemetry`` -> chaos checks,
CLI and dashboards read them. Imports go one way too: the package layers, lowest first, are in
:mod:`leasekit.layers`.
"""

__version__ = "0.1.0"
