"""P-side (prefill) components of LeaseKitConnector's worker: each owns one part of P's lease keeping and
talks to the worker through a narrow, documented interface (no attribute set behind another's back).

- :mod:`leasekit.vllm.prefill.expiry`: the expiry heap that indexes vLLM's ``_reqs_to_send`` and finds
  the leases due for reaping without scanning them all.
- :mod:`leasekit.vllm.prefill.notifications`: D's notifications on P (heartbeats, completions, hellos),
  parsed, bound to their D agent, capped by the max hold; answered with verdicts and acknowledgements;
- :mod:`leasekit.vllm.prefill.pledges`: the grant pledge (no block of a fresh lease freed early);
- :mod:`leasekit.vllm.prefill.listener`: the side-channel handshake listener that survives bad requests.

The notification handling and pledges are still mixins of the worker class (they read the worker's
vLLM attributes); the expiry heap is a component with its own interface.
"""
