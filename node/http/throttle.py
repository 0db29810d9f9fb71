"""A token bucket of bytes per second, shared by the requests it paces (the audit's reads
of snapshot files, node/http/audit.py): whatever many executors ask at once, the node sends
no more than the rate, so that an audit never starves the traffic it serves meanwhile."""

from __future__ import annotations

import asyncio
import time

BURST_S = 0.25  # a bucket holds a quarter second of its rate: short bursts, no long ones


class ByteRate:
    """``take(n)`` returns once ``n`` bytes fit in the rate; 0 bytes/s: no cap. Waiters go
    one after the other (a lock), so none is starved by smaller ones."""

    def __init__(self, bytes_per_s: int) -> None:
        self.rate = bytes_per_s
        self._capacity = max(1, int(bytes_per_s * BURST_S))
        self._tokens = float(self._capacity)
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def take(self, size: int) -> None:
        if self.rate <= 0 or size <= 0:
            return
        async with self._lock:
            self._refill()
            # A chunk larger than the bucket goes through once the bucket is full, owing
            # the rest: the next waiters wait for the debt to be paid.
            self._tokens -= size
            if self._tokens < 0:
                await asyncio.sleep(-self._tokens / self.rate)
                self._refill()

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self._capacity, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
