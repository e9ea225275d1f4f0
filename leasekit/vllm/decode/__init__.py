"""D-side (decode) components of LeaseKitConnector's worker, each a plain object the worker owns and
builds in ``_lk_setup`` with everything it needs passed in:

- :mod:`leasekit.vllm.decode.vllmstate`: :class:`VllmDState`, the one documented door to the vLLM worker
  state D reads (remote agents, receive maps, the NIXL wrapper, ``_send_pending_recv_notifs``);
- :mod:`leasekit.vllm.decode.gate`: :class:`DReadGate` (``_lk_gate``), D's read gate, which holds each
  finished KV read until P proved the lease covered it (the fail-closed protocol), with D's end of the
  verdict channel;
- :mod:`leasekit.vllm.decode.heartbeats`: :class:`DHeartbeatSender` (``_lk_dbeats``), D's heartbeat
  sending (counted, traced) and the chaos fault points on that path and the forward pass;
- :mod:`leasekit.vllm.decode.hooks`: :class:`DHooks`, the worker's stateless overrides of vLLM's
  ``_read_blocks``, ``_pop_done_transfers`` and ``_send_heartbeats``, forwarding to the two components.
"""
