"""Per-process virtual clocks: ``local = offset_s + rate * true_time`` (seconds)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessClock:
    """A process's monotonic clock as a function of the world's true time.

    Attributes:
        offset_s: local reading at true time 0 (a time-namespace offset, a boot-time difference).
        rate: local seconds per true second (1.0 = exact; 1.001 runs 0.1% fast). Must be > 0.

    Raises:
        ValueError: rate <= 0 or a value not finite.
    """

    offset_s: float = 0.0
    rate: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.offset_s) and math.isfinite(self.rate)) or self.rate <= 0:
            raise ValueError(f"clock needs finite offset and rate > 0, got offset={self.offset_s}, rate={self.rate}")

    def local(self, true_s: float) -> float:
        """The local reading at true time ``true_s``."""
        return self.offset_s + self.rate * true_s

    def true(self, local_s: float) -> float:
        """The true time at which this clock reads ``local_s``."""
        return (local_s - self.offset_s) / self.rate

    def local_span(self, true_span_s: float) -> float:
        """A true duration as measured by this clock."""
        return self.rate * true_span_s
