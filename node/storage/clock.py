"""Time enters the engine through this object so that tests can drive it: the node builds
one where it is assembled (``node.http.app.build_app``) and hands it to every part that
reads the time or waits for it, background loops included."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int:
        """Wall-clock milliseconds since the epoch (for metadata such as creation times)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for timeouts and intervals)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` have passed on this clock (a background loop's period)."""
        ...

    async def wait(self, event: asyncio.Event, timeout_s: float) -> bool:
        """Return once ``event`` is set or ``timeout_s`` have passed on this clock, whichever
        comes first; whether the event is set (a loop that also runs on request)."""
        ...


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait(self, event: asyncio.Event, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)
        return event.is_set()
