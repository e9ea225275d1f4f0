"""Chaos scenarios against a real P/D pair: scenario loader, workload (generator), fault injectors
(nemesis), checks (checker) and reports, kept apart as in Jepsen. A verdict is PASS, FAIL or
UNKNOWN, always with the bound, the measured value and the timeline that produced it.
"""

PASS = "PASS"
FAIL = "FAIL"
UNKNOWN = "UNKNOWN"
VERDICTS = (PASS, FAIL, UNKNOWN)
