"""P-side (prefill) components of LeaseKitConnector's worker: each owns one part of P's lease keeping and
is built with everything it uses passed in (no attribute set behind another's back). The rules are
one pure object, :class:`leasekit.lease.pkeeping.PLeaseKeeping`; these components apply its decisions
to vLLM's maps, spans, metrics and logs. The worker (:class:`leasekit.vllm.connector.LeaseKitPullWorker`)
builds them with :func:`leasekit.vllm.prefill.hooks.build_prefill`, and its vLLM hooks
(:class:`leasekit.vllm.prefill.hooks.PHooks`) delegate to them.

- :mod:`leasekit.vllm.prefill.vllmstate`: the one interface to vLLM's lease state on the worker
  (``_reqs_to_send``, ``_reqs_to_process``, completion counts, ``E``);
- :mod:`leasekit.vllm.prefill.expiry`: the expiry heap that indexes vLLM's ``_reqs_to_send`` and hands
  vLLM's reaper only the leases due, without scanning them all;
- :mod:`leasekit.vllm.prefill.notifications`: the notification intake (heartbeats, completions),
  parsed, bound to their D agent, capped by the max hold;
- :mod:`leasekit.vllm.prefill.replies`: P's side of the verdict channel (hellos, verdicts, heartbeat
  acknowledgements over ZMQ);
- :mod:`leasekit.vllm.prefill.pledges`: the grant pledge (no block of a fresh lease freed early);
- :mod:`leasekit.vllm.prefill.listener`: the side-channel handshake listener that survives bad requests
  (the scheduler's).
"""
