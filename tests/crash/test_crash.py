"""Crash tests: workload + nemesis (SIGKILL) + checker, against the node as a real process.

Writers add entries of random sizes to several ledgers over HTTP (single adds at chosen
ids, appends, batches) and record what was acknowledged and the LACs they saw. The nemesis
SIGKILLs the node at a random moment, or the node kills itself at a named crash point
inside a checkpoint or a journal rotation. The checker restarts the node and proves that
every acknowledged entry reads back byte for byte and that no LAC went backwards.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from node.wire import batch_entry_ids, encode_batch
from tests.harness.clients import BATCH, OCTET, REPLY_LOST, read_ledger
from tests.harness.node import NodeProcess

RANDOM_TRIALS = 20
# Ledgers of earlier trials read back after each restart, besides all of the last trial's and
# the shared ones; the final check reads back every ledger (a lost entry stays lost).
OLDER_CHECKED = 4
WRITERS = 6
MAX_PAYLOAD = 24 * 1024
CRASH_POINTS = [
    "checkpoint.before_entrylog",
    "checkpoint.after_entrylog_fsync",
    "checkpoint.after_index",
    "checkpoint.after_mark",
    "journal.rotate.before",
    "journal.rotate.after",
]


@dataclass
class Acknowledged:
    """What the node acknowledged: the checker's model."""

    entries: dict[tuple[int, int], bytes] = field(default_factory=dict)
    lac: dict[int, int] = field(default_factory=dict)

    def ack(self, ledger_id: int, entry_id: int, payload: bytes, lac: int) -> None:
        previous = self.entries.setdefault((ledger_id, entry_id), payload)
        assert previous == payload, f"({ledger_id}, {entry_id}) acknowledged twice, differently"
        self.lac[ledger_id] = max(self.lac.get(ledger_id, -1), lac)


async def _writer(
    session: aiohttp.ClientSession,
    url: str,
    rng: random.Random,
    own_ledger: int,
    shared_ledgers: list[int],
    acked: Acknowledged,
) -> None:
    """Adds until the node dies; only successful replies count as acknowledged."""
    next_id = 0
    while True:
        size = rng.choice((rng.randrange(1, 200), rng.randrange(200, MAX_PAYLOAD)))
        payload = rng.randbytes(size)
        choice = rng.random()
        try:
            if choice < 0.4:  # a chosen entry id on the writer's own ledger
                async with session.put(
                    f"{url}/api/v1/ledgers/{own_ledger}/entries/{next_id}",
                    data=payload,
                    headers=OCTET,
                ) as r:
                    assert r.status == 201, await r.text()
                    body = await r.json()
                acked.ack(own_ledger, next_id, payload, body["lac"])
                next_id += 1
            elif choice < 0.8 and shared_ledgers:  # append to a ledger shared by writers
                ledger = rng.choice(shared_ledgers)
                async with session.post(
                    f"{url}/api/v1/ledgers/{ledger}/entries", data=payload, headers=OCTET
                ) as r:
                    assert r.status == 201, await r.text()
                    body = await r.json()
                acked.ack(ledger, body["entryId"], payload, body["lac"])
            else:  # a batch, one acknowledgment for all
                ledger = rng.choice(shared_ledgers)
                payloads = [
                    rng.randbytes(rng.randrange(0, 4096)) for _ in range(rng.randrange(1, 20))
                ]
                async with session.post(
                    f"{url}/api/v1/ledgers/{ledger}/entries",
                    data=encode_batch(payloads),
                    headers=BATCH,
                ) as r:
                    assert r.status == 201, await r.text()
                    body = await r.json()
                for entry_id, p in zip(batch_entry_ids(body), payloads, strict=True):
                    acked.ack(ledger, entry_id, p, body["lac"])
        except REPLY_LOST:
            return  # the node is gone: whatever was in flight is not acknowledged


async def _run_workload(
    node: NodeProcess,
    rng: random.Random,
    acked: Acknowledged,
    shared: list[int],
    kill_after_s: float | None,
) -> None:
    async with aiohttp.ClientSession() as session:

        async def create() -> int:
            async with session.post(f"{node.url}/api/v1/ledgers") as r:
                assert r.status == 201
                return int((await r.json())["ledgerId"])

        try:
            own = [await create() for _ in range(WRITERS)]
            if not shared:  # appended to by every writer, in every trial
                shared.extend([await create(), await create()])
        except REPLY_LOST:
            # Killed (or a crash point reached: a timed checkpoint may come first on a loaded
            # machine) before anything was written: the restarts are still checked.
            return
        writers = [
            asyncio.create_task(
                _writer(session, node.url, random.Random(rng.random()), own[i], shared, acked)
            )
            for i in range(WRITERS)
        ]
        if kill_after_s is not None:
            await asyncio.sleep(kill_after_s)
            await asyncio.to_thread(node.kill)
        done, _ = await asyncio.wait(writers, timeout=60)
        assert len(done) == WRITERS, "writers did not stop after the node died"
        for task in done:
            task.result()


def _check(node: NodeProcess, acked: Acknowledged, ledgers: set[int] | None = None) -> None:
    """Every acknowledged entry (of ``ledgers``, else of all) reads back byte for byte; no
    LAC went backwards."""
    by_ledger: dict[int, dict[int, bytes]] = {}
    for (ledger, entry), payload in acked.entries.items():
        if ledgers is None or ledger in ledgers:
            by_ledger.setdefault(ledger, {})[entry] = payload
    for ledger, entries in by_ledger.items():
        meta = node.get_json(f"/api/v1/ledgers/{ledger}")
        assert meta["lac"] >= acked.lac[ledger], (
            f"ledger {ledger}: LAC went back from {acked.lac[ledger]} to {meta['lac']}"
        )
        stored = read_ledger(node, ledger)
        missing = sorted(set(entries) - set(stored))
        assert not missing, f"ledger {ledger}: acknowledged entries lost: {missing[:10]}"
        for entry, payload in entries.items():
            assert stored[entry] == payload, f"({ledger}, {entry}) reads back different bytes"
        # Single reads go through the caches and the entry log path, not only the range.
        for entry in random.Random(ledger).sample(sorted(entries), min(5, len(entries))):
            assert node.get_bytes(f"/api/v1/ledgers/{ledger}/entries/{entry}") == entries[entry]


def random_kills(data: Path, seed: int, env: dict[str, str] | None = None) -> None:
    """The nemesis: RANDOM_TRIALS runs of the workload, each SIGKILLed at a random moment.
    After every restart, before new writes, the checker reads back what the killed trial
    wrote and a sample of the older ledgers (a check of everything after every restart grew
    with the square of the trials); at the end, all that was acknowledged."""
    rng = random.Random(seed)
    acked = Acknowledged()
    shared: list[int] = []
    older: list[int] = []
    for trial in range(RANDOM_TRIALS):
        node = NodeProcess(data, env=env)
        node.start()
        if trial:
            last = set(acked.lac) - set(older)
            sample = random.Random(trial).sample(older, min(OLDER_CHECKED, len(older)))
            _check(node, acked, last | set(shared) | set(sample))
            older.extend(sorted(last - set(shared)))
        asyncio.run(_run_workload(node, rng, acked, shared, kill_after_s=rng.uniform(0.2, 1.2)))
        node.kill()
    node = NodeProcess(data, env=env)
    node.start()
    try:
        _check(node, acked)
        assert len(acked.entries) > 1000, "the workload acknowledged too little to prove much"
    finally:
        assert node.terminate() == 0


def crash_at(data: Path, point: str, env: dict[str, str] | None = None) -> None:
    """The workload until the node SIGKILLs itself at the named point; then two restarts,
    each reading back all that was acknowledged (the recovery itself left a clean state)."""
    rng = random.Random(point)
    acked = Acknowledged()
    node = NodeProcess(data, env={**(env or {}), "NODE_CRASH_POINTS": json.dumps([point])})
    node.start()
    asyncio.run(_run_workload(node, rng, acked, [], kill_after_s=None))
    assert node.proc is not None
    assert node.proc.wait(10) == -signal.SIGKILL, "the crash point was never reached"
    for _ in range(2):
        node = NodeProcess(data, env=env)
        node.start()
        try:
            _check(node, acked)
        finally:
            assert node.terminate() == 0


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_nothing_acknowledged(tmp_path: Path) -> None:
    random_kills(tmp_path / "data", seed=20261122)


@pytest.mark.slow
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_inside_checkpoint_and_rotation_loses_nothing(tmp_path: Path, point: str) -> None:
    crash_at(tmp_path / "data", point)
