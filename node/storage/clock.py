"""Time enters the engine through this object so that tests can drive it."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int:
        """Wall-clock milliseconds since the epoch (for metadata such as creation times)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for timeouts and intervals)."""
        ...


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        return time.monotonic()
