"""Parts of ``benchmarks/step_cost.py``: the per-engine-step cost of vLLM 0.32.0's stock NIXL pull
worker and of LeaseKit's worker, both built and called as the engine builds and calls them.

Each module imports only those before it: ``build`` (the workers and connectors, no NIXL agent),
``drive`` (one engine step, P and D sides), ``measure`` (interleaved timing, memory per lease),
``report`` (goals, verdicts, tables; pure).
"""
