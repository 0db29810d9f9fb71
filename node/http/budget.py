"""The node-wide budget of request-body bytes (see node/http/bodies.py)."""

from __future__ import annotations

import asyncio


class BodyBudget:
    """Bytes of request bodies the node holds at once. Not first come, first served: a body
    that fits takes its bytes at once, even while bigger ones wait for room."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self._freed = asyncio.Event()  # set (and replaced) whenever bytes come back

    def try_take(self, size: int) -> bool:
        """Take ``size`` bytes if there is room now (no coroutine: the common case, cheap)."""
        if self.in_use + size > self.capacity:
            return False
        self.in_use += size
        return True

    async def take(self, size: int, wait_s: float) -> bool:
        """Take ``size`` bytes, waiting up to ``wait_s`` for room; False if none came."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while self.in_use + size > self.capacity:
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                async with asyncio.timeout(left):
                    await self._freed.wait()
            except TimeoutError:
                return False
        self.in_use += size
        return True

    def give_back(self, size: int) -> None:
        if size:
            self.in_use -= size
            self._freed.set()
            self._freed = asyncio.Event()
