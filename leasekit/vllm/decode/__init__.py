"""D-side (decode) parts of LeaseKitConnector's worker.

- :mod:`leasekit.vllm.decode.heartbeats`: D's heartbeat sending (sequence tokens, the hello) and the
  chaos fault points on that path;
- :mod:`leasekit.vllm.decode.gate`: D's read gate, which holds each finished KV read until P proved the
  lease covered it (the fail-closed protocol).
"""
