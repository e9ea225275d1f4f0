"""The parts of ``benchmarks/telemetry_overhead.py`` (the command; see its docstring).

Data flows one way, each module importing only those above it:

- ``stats``: pure statistics of measured rounds: percentiles, spreads, ratios, counter deltas.
- ``verdicts``: the goal verdicts (met / not met / inconclusive) from ratios and spreads.
- ``spans``: span-volume counting on a pair's span files and the O(requests) verdict.
- ``report``: derives summaries, ratios and verdicts from the measurements; the human table.
- ``pairs``: the real pairs: start, park, unpark, drain, stop; ports; metric scrapes.
- ``workload``: what runs on a pair: seeded prompts, round order, routed rounds, queue phases.
- ``runner``: one whole run (start, warm up, rounds, queue phases, teardown) and the result file.

Nothing here imports vLLM or leasekit's cluster code at import time, so ``--help`` and the unit
tests (tests/unit/test_telemetry_overhead_stats.py) run without a vLLM stack.
"""
