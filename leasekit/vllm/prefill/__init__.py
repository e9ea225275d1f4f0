"""P-side (prefill) components of LeaseKitConnector's worker: each owns one part of P's lease keeping and
talks to the worker through a narrow, documented interface (no attribute set behind another's back).

- :mod:`leasekit.vllm.prefill.expiry`: the expiry heap that indexes vLLM's ``_reqs_to_send`` and finds
  the leases due for reaping without scanning them all.
"""
