"""Start and stop real vLLM prefill (P) and decode (D) servers and route requests P -> D."""
