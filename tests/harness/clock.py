"""The fake clock: a ``Clock`` whose time moves only when the test moves it.

Its ``sleep`` and ``wait`` return once the test has moved time to their deadline, so a
background loop runs one period per ``tick`` with no real waiting:

    clock = FakeClock()
    task = asyncio.create_task(loop_under_test(clock))
    for _ in range(3):
        await clock.tick()  # once the loop sleeps: time jumps to its deadline, it wakes
    await clock.sleeping()  # the third period's work is done: the loop sleeps again
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

EPOCH_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z: what now_ms reads at monotonic 0
REAL_WAIT_S = 10.0  # how long sleeping() waits for a task to sleep before the test fails
NS_PER_S, NS_PER_MS = 1_000_000_000, 1_000_000
# Settings of a storage on this clock: the journal ages its open group on the storage's
# clock, which stands still, so it writes a group once its queue is empty instead.
ON_FAKE_CLOCK: dict[str, Any] = {"journal_flush_when_queue_empty": True}


@dataclass(order=True)
class _Sleeper:
    deadline_ns: int
    seq: int
    future: asyncio.Future[None] = field(compare=False)
    loop: asyncio.AbstractEventLoop = field(compare=False)


class FakeClock:
    """Both of a ``Clock``'s readings stand still until the test calls ``advance``,
    ``advance_to`` or ``tick``; ``sleep_in_thread`` (a worker thread's throttle) moves
    them by what it sleeps, as nothing else would while it waits. Thread-safe: GC's
    throttle sleeps from its worker thread."""

    def __init__(self, start_s: float = 0.0, epoch_ms: int = EPOCH_MS) -> None:
        self._lock = threading.Lock()
        # Integer nanoseconds: steps such as "an hour less a millisecond" add up exactly.
        self._ns = _ns(start_s)
        self._epoch_ms = epoch_ms
        self._sleepers: list[_Sleeper] = []
        self._seq = 0
        self._changed: asyncio.Event | None = None  # set when a task starts to sleep

    # --- the Clock ---------------------------------------------------------------------------

    def now_ms(self) -> int:
        with self._lock:
            return self._epoch_ms + self._ns // NS_PER_MS

    def monotonic(self) -> float:
        with self._lock:
            return self._ns / NS_PER_S

    async def sleep(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if seconds <= 0:
                future.set_result(None)
            else:
                self._seq += 1
                self._sleepers.append(_Sleeper(self._ns + _ns(seconds), self._seq, future, loop))
                self._sleepers.sort()
        if self._changed is not None:
            self._changed.set()
        try:
            await future
        finally:
            with self._lock:
                self._sleepers = [s for s in self._sleepers if s.future is not future]

    async def wait(self, event: asyncio.Event, timeout_s: float) -> bool:
        if event.is_set():
            return True
        waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(self.sleep(timeout_s))]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
            for task in waits:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return event.is_set()

    # --- moving time -------------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Move time on by ``seconds``; sleepers whose deadline it reaches wake."""
        with self._lock:
            self._ns += max(0, _ns(seconds))
        self._wake_due()

    def advance_to(self, seconds: float) -> None:
        """Move time on to ``seconds`` (never back); sleepers whose deadline it reaches wake."""
        with self._lock:
            self._ns = max(self._ns, _ns(seconds))
        self._wake_due()

    def _wake_due(self) -> None:
        with self._lock:
            due = [s for s in self._sleepers if s.deadline_ns <= self._ns]
            self._sleepers = [s for s in self._sleepers if s.deadline_ns > self._ns]
        for sleeper in due:
            sleeper.loop.call_soon_threadsafe(_wake, sleeper.future)

    def sleep_in_thread(self, seconds: float) -> None:
        """A blocking sleep for a worker thread (GC's compaction throttle): time moves by it."""
        self.advance(seconds)

    # --- driving loops -----------------------------------------------------------------------

    async def sleeping(self, count: int = 1) -> float:
        """Once at least ``count`` tasks sleep on this clock (waiting in real time, at most
        REAL_WAIT_S): the earliest deadline."""
        return await self._sleeping(count) / NS_PER_S

    async def tick(self, sleepers: int = 1) -> None:
        """One period of the earliest sleeper: once ``sleepers`` tasks sleep on this clock
        (every loop the test drives is idle again), time jumps to the earliest deadline."""
        deadline_ns = await self._sleeping(sleepers)
        with self._lock:
            self._ns = max(self._ns, deadline_ns)
        self._wake_due()
        await asyncio.sleep(0)  # the woken tasks run from here on

    async def _sleeping(self, count: int) -> int:
        self._changed = self._changed or asyncio.Event()
        async with asyncio.timeout(REAL_WAIT_S):
            while True:
                with self._lock:
                    if len(self._sleepers) >= count:
                        return self._sleepers[0].deadline_ns
                self._changed.clear()
                await self._changed.wait()


def _ns(seconds: float) -> int:
    return round(seconds * NS_PER_S)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
