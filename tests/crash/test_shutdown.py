"""Graceful shutdown: SIGTERM in the middle of concurrent writes loses nothing that was
acknowledged, exits 0, and leaves a clean checkpoint (the next start replays nothing)."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import aiohttp

from tests.crash.test_crash import WRITERS, Acknowledged, _check, _writer
from tests.harness.node import NodeProcess

LONG_POLL_MS = 50_000


async def _write_then_terminate(node: NodeProcess, acked: Acknowledged) -> float:
    """Writers run; SIGTERM lands while they do. Returns how long a pending long poll took
    to be answered once shutdown began (it must not hold the shutdown for its timeout)."""
    rng = random.Random(7)
    async with aiohttp.ClientSession() as session:
        ledgers = []
        for _ in range(WRITERS + 2):
            async with session.post(f"{node.url}/api/v1/ledgers") as r:
                ledgers.append(int((await r.json())["ledgerId"]))
        writers = [
            asyncio.create_task(
                _writer(
                    session, node.url, random.Random(rng.random()), ledgers[i], ledgers[-2:], acked
                )
            )
            for i in range(WRITERS)
        ]
        idle = ledgers[0] + 1000
        async with session.put(f"{node.url}/api/v1/ledgers/{idle}") as r:
            assert r.status == 201
        poll = asyncio.create_task(
            session.get(f"{node.url}/api/v1/ledgers/{idle}/lac?after=0&timeoutMs={LONG_POLL_MS}")
        )
        await asyncio.sleep(1.0)
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        response = await asyncio.wait_for(poll, 30)
        answered = time.monotonic() - began
        assert response.status == 200 and (await response.json())["lac"] == -1
        await asyncio.wait(writers, timeout=60)
        for task in writers:
            task.result()
    return answered


def test_sigterm_during_writes_is_clean(tmp_path: Path) -> None:
    data = tmp_path / "data"
    node = NodeProcess(data)
    node.start()
    acked = Acknowledged()
    answered = asyncio.run(_write_then_terminate(node, acked))
    assert node.proc is not None and node.proc.wait(60) == 0
    assert answered < 10, f"a long poll held the shutdown for {answered:.1f} s"
    assert len(acked.entries) > 100
    assert "stopped cleanly" in node.log()

    again = NodeProcess(data)
    again.start()
    try:
        assert "replayed 0 WAL records" in again.log().rsplit("listening on", 2)[-2]
        _check(again, acked)
    finally:
        assert again.terminate() == 0
