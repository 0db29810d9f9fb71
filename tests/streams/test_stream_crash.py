"""Streams under SIGKILL, with the node as a real process (tests/harness/node.py): small
ledgers (a few entries, no minimum age) so that rollovers happen many times a second.

(a) During appends with rollover: several appenders record every acknowledged position and
    payload; the node is killed at random moments. After each restart every acknowledged
    position reads back byte for byte through the stream's read route, and the stream's
    ledgers are consistent (ascending, none lost from the middle, all but the last closed,
    entries 0..n-1 in each).
(b) During acknowledgments: concurrent acknowledgments of a few cursors (and appends rolling
    ledgers meanwhile); an acknowledgment answered 200 survives: the cursor's mark-delete
    after the restart is at or after it.
(c) During a retention run (paced deletions of many consumed, expired ledgers): after the
    restart no cursor's mark-delete names a deleted ledger, every entry at or after the
    slowest mark-delete reads back, the stream's first ledger exists, and the ledgers the
    stream no longer names were deleted at start. The next run finishes the job.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from node.streams.model import Position
from node.wire import batch_positions, decode_stream_frames, encode_batch
from tests.harness.clients import BATCH, OCTET, REPLY_LOST, http_status, read_stream
from tests.harness.node import NodeProcess

ENV = {"NODE_RETENTION_SCHEDULER_ENABLED": "false"}  # only the test runs retention
APPEND_TRIALS = 12
ACKED_PER_TRIAL = (200, 500)  # a trial's kill comes after this many new acknowledgments (range)
KILL_JITTER_S = 0.2  # and up to this much later, so it lands at any point of a request
ACK_TRIALS = 6
FIRST_BATCH_TIMEOUT_S = 60.0  # bounds a hang only: the kill timer starts after one batch
RETENTION_TRIALS = 4
APPENDERS = 5


def start_node(data: Path, env: dict[str, str] | None = None) -> NodeProcess:
    node = NodeProcess(data, {**ENV, **(env or {})})
    try:
        node.start()
    except AssertionError as e:
        pytest.fail(f"the node did not start on {data}:\n{e}", pytrace=False)
    return node


def pos(text: str) -> Position:
    return Position.parse(text)


def put_stream(node: NodeProcess, name: str, policies: dict[str, int]) -> None:
    async def put() -> None:
        async with (
            aiohttp.ClientSession() as session,
            session.put(f"{node.url}/api/v1/streams/{name}", json=policies) as r,
        ):
            assert r.status in (200, 201), await r.text()

    asyncio.run(put())


# --- (a) appends with rollover --------------------------------------------------------------


@dataclass
class Acknowledged:
    entries: dict[Position, bytes] = field(default_factory=dict)

    def ack(self, position: Position, payload: bytes) -> None:
        previous = self.entries.setdefault(position, payload)
        assert previous == payload, f"{position} acknowledged twice, with different bytes"


async def _appender(
    session: aiohttp.ClientSession, url: str, rng: random.Random, acked: Acknowledged
) -> None:
    """Appends until the node dies; only answered appends count as acknowledged."""
    path = f"{url}/api/v1/streams/orders/entries"
    while True:
        try:
            if rng.random() < 0.7:
                payload = rng.randbytes(rng.choice((rng.randrange(1, 100), rng.randrange(1, 8192))))
                async with session.post(path, data=payload, headers=OCTET) as r:
                    assert r.status == 201, await r.text()
                    body = await r.json()
                acked.ack(pos(body["position"]), payload)
            else:
                payloads = [
                    rng.randbytes(rng.randrange(0, 2048)) for _ in range(rng.randrange(1, 6))
                ]
                async with session.post(path, data=encode_batch(payloads), headers=BATCH) as r:
                    assert r.status == 201, await r.text()
                    body = await r.json()
                for position, payload in zip(batch_positions(body), payloads, strict=True):
                    acked.ack(position, payload)
        except REPLY_LOST:
            return  # the node is gone: what was in flight is not acknowledged


async def _append_until_killed(
    node: NodeProcess, rng: random.Random, acked: Acknowledged, kill_after_acks: int
) -> None:
    """The kill is counted in acknowledgments, not seconds: a slow machine gets as many."""
    target = len(acked.entries) + kill_after_acks
    async with aiohttp.ClientSession() as session:
        appenders = [
            asyncio.create_task(_appender(session, node.url, random.Random(rng.random()), acked))
            for _ in range(APPENDERS)
        ]
        async with asyncio.timeout(FIRST_BATCH_TIMEOUT_S):  # bounds a hang only
            while len(acked.entries) < target:
                stopped = [t for t in appenders if t.done()]
                for task in stopped:
                    task.result()  # an appender's own failure, raised as it is
                assert not stopped, "an appender lost the node before the kill"
                await asyncio.sleep(0.005)
        await asyncio.sleep(rng.uniform(0, KILL_JITTER_S))
        await asyncio.to_thread(node.kill)
        done, _ = await asyncio.wait(appenders, timeout=60)
        assert len(done) == APPENDERS, "appenders did not stop after the node died"
        for task in done:
            task.result()


def _check_appends(node: NodeProcess, acked: Acknowledged, seen: list[int]) -> None:
    """The stream is consistent and holds every acknowledged entry, byte for byte."""
    ledgers = node.get_json("/api/v1/streams/orders")["ledgers"]
    ids = [info["ledgerId"] for info in ledgers]
    assert ids == sorted(set(ids)), f"ledger ids out of order or repeated: {ids}"
    lost = sorted(set(seen) - set(ids))
    assert not lost, f"ledgers gone from the stream (no retention ran): {lost}"
    open_ = [info["ledgerId"] for info in ledgers[:-1] if info["closedTime"] is None]
    assert not open_, f"ledgers before the last are not closed: {open_}"
    assert ledgers[-1]["closedTime"] is None, "the last ledger does not take appends"
    # The storage agrees: the stream's ledgers closed but the last, and no ledger of the
    # stream that it does not name (a rollover cut short leaves one; start deletes it).
    storage = {
        m["ledgerId"]: m
        for m in node.get_json("/api/v1/ledgers")["ledgers"]
        if m["properties"].get("stream") == "orders"
    }
    assert sorted(storage) == ids, "the storage's ledgers of the stream differ from its list"
    assert [storage[lid]["state"] for lid in ids] == ["closed"] * (len(ids) - 1) + ["open"]
    stored = read_stream(node, "orders", Position(ids[0], 0))
    positions = [p for p, _ in stored]
    assert positions == sorted(set(positions)), "positions do not increase"
    in_ledger: dict[int, list[int]] = {lid: [] for lid in ids}
    for p in positions:
        in_ledger[p.ledger_id].append(p.entry_id)  # a KeyError: a ledger the stream lost
    for info in ledgers:
        lid = info["ledgerId"]
        assert in_ledger[lid] == list(range(info["entries"])), f"ledger {lid}: a hole"
        assert storage[lid]["lastEntryId"] == info["entries"] - 1
    by_position = dict(stored)
    missing = sorted(set(acked.entries) - set(by_position))
    assert not missing, f"acknowledged entries lost: {[str(p) for p in missing[:10]]}"
    for position, payload in acked.entries.items():
        assert by_position[position] == payload, f"{position} reads back different bytes"
    # A read from an exact acknowledged position starts there.
    for position in random.Random(len(acked.entries)).sample(sorted(acked.entries), 5):
        body = node.get_bytes(f"/api/v1/streams/orders/entries?from={position}&limit=1")
        assert decode_stream_frames(body) == [(position, acked.entries[position])]
    seen[:] = ids


@pytest.mark.slow
def test_sigkill_during_appends_with_rollover(tmp_path: Path) -> None:
    rng = random.Random(20260611)
    data = tmp_path / "data"
    acked = Acknowledged()
    seen: list[int] = []
    for trial in range(APPEND_TRIALS):
        node = start_node(data)
        if trial:
            _check_appends(node, acked, seen)  # what survived the last kill, before new writes
        else:
            put_stream(
                node, "orders", {"maxEntriesPerLedger": 8, "minLedgerRolloverTimeMinutes": 0}
            )
        asyncio.run(_append_until_killed(node, rng, acked, rng.randrange(*ACKED_PER_TRIAL)))
    node = start_node(data)
    try:
        _check_appends(node, acked, seen)
        assert len(seen) > 20 * APPEND_TRIALS, f"only {len(seen)} ledgers: too few rollovers"
    finally:
        assert node.terminate() == 0


# --- (b) acknowledgments --------------------------------------------------------------------


@dataclass
class CursorModel:
    name: str
    next_index: int = 0  # the next position index an acknowledger takes
    answered: int = -1  # the highest index whose acknowledgment was answered 200
    sent: int = -1  # the highest index ever sent


async def _acknowledger(
    session: aiohttp.ClientSession,
    url: str,
    rng: random.Random,
    cursor: CursorModel,
    positions: list[Position],
) -> None:
    path = f"{url}/api/v1/streams/acks/cursors/{cursor.name}/ack"
    while cursor.next_index < len(positions):
        index = cursor.next_index
        cursor.next_index += rng.randrange(1, 6)
        cursor.sent = max(cursor.sent, index)
        try:
            async with session.post(path, json={"position": str(positions[index])}) as r:
                assert r.status == 200, await r.text()
                body = await r.json()
        except REPLY_LOST:
            return
        assert pos(body["markDeletePosition"]) >= positions[index]
        cursor.answered = max(cursor.answered, index)


async def _append_batches(
    session: aiohttp.ClientSession,
    url: str,
    count: int,
    positions: list[Position],
    first_done: asyncio.Event | None = None,
) -> None:
    """``count`` batches of 8 entries (one ledger each); stops quietly when the node dies.
    ``first_done`` is set once one batch is answered: the kill waits for it, so a busy
    machine cannot kill the node before any batch made it (the first batch after a restart
    rolls over, a few fsyncs)."""
    for n in range(count):
        try:
            payloads = [f"{len(positions) + i}".encode() * 10 for i in range(8)]
            async with session.post(
                f"{url}/api/v1/streams/acks/entries", data=encode_batch(payloads), headers=BATCH
            ) as r:
                assert r.status == 201, await r.text()
                positions.extend(batch_positions(await r.json()))
        except REPLY_LOST:
            assert n, "the first batch failed"
            return
        if first_done is not None:
            first_done.set()


async def _ack_until_killed(
    node: NodeProcess,
    rng: random.Random,
    cursors: list[CursorModel],
    positions: list[Position],
    kill_after_s: float,
) -> None:
    async with aiohttp.ClientSession() as session:
        tasks = [
            asyncio.create_task(
                _acknowledger(session, node.url, random.Random(rng.random()), cursor, positions)
            )
            for cursor in cursors
            for _ in range(3)  # three concurrent acknowledgers per cursor
        ]
        first_done = asyncio.Event()
        appender = _append_batches(session, node.url, 10_000, positions, first_done)
        tasks.append(asyncio.create_task(appender))
        await asyncio.wait_for(first_done.wait(), FIRST_BATCH_TIMEOUT_S)
        await asyncio.sleep(kill_after_s)
        await asyncio.to_thread(node.kill)
        done, _ = await asyncio.wait(tasks, timeout=60)
        assert len(done) == len(tasks), "clients did not stop after the node died"
        for task in done:
            task.result()


@pytest.mark.slow
def test_sigkill_during_acknowledgments(tmp_path: Path) -> None:
    rng = random.Random(77)
    data = tmp_path / "data"
    node = start_node(data)
    put_stream(node, "acks", {"maxEntriesPerLedger": 8, "minLedgerRolloverTimeMinutes": 0})
    positions: list[Position] = []
    cursors = [CursorModel(f"c{i}") for i in range(3)]

    async def prepare() -> None:
        async with aiohttp.ClientSession() as session:
            await _append_batches(session, node.url, 250, positions)
            for cursor in cursors:
                async with session.put(
                    f"{node.url}/api/v1/streams/acks/cursors/{cursor.name}",
                    json={"start": "earliest"},
                ) as r:
                    assert r.status == 201, await r.text()

    asyncio.run(prepare())
    assert len(positions) == 2000
    for trial in range(ACK_TRIALS + 1):
        if trial:
            node = start_node(data)  # what survived the last kill
        for cursor in cursors:
            mark = pos(
                node.get_json(f"/api/v1/streams/acks/cursors/{cursor.name}")["markDeletePosition"]
            )
            if cursor.answered >= 0:
                assert mark >= positions[cursor.answered], (
                    f"cursor {cursor.name}: acknowledged {positions[cursor.answered]} was "
                    f"answered, but its mark-delete after the restart is {mark}"
                )
            assert cursor.sent < 0 or mark <= positions[cursor.sent], (
                f"cursor {cursor.name}: mark-delete {mark} past anything acknowledged"
            )
            # The mark-delete is where acknowledgments resume: never behind what the node
            # answered, so the model follows the node.
            cursor.next_index = max(cursor.next_index, cursor.answered + 1)
        if trial < ACK_TRIALS:
            asyncio.run(_ack_until_killed(node, rng, cursors, positions, rng.uniform(0.15, 0.6)))
    assert node.terminate() == 0
    assert all(c.answered > 100 for c in cursors), [c.answered for c in cursors]


# --- (c) retention runs ---------------------------------------------------------------------


@dataclass
class RetainedStream:
    name: str
    entries: dict[Position, bytes]
    ledgers: list[int]  # as the stream named them before any retention ran
    cursors: dict[str, Position]  # acknowledged, answered
    keep_from: int = 0  # the ledger holding the slowest mark-delete: retention keeps it


async def _prepare_retention(node: NodeProcess, name: str, rng: random.Random) -> RetainedStream:
    """About 40 ledgers of 3 entries, consumed far into the stream by two cursors."""
    entries: dict[Position, bytes] = {}
    async with aiohttp.ClientSession() as session:
        async with session.put(
            f"{node.url}/api/v1/streams/{name}",
            json={
                "maxEntriesPerLedger": 3,
                "minLedgerRolloverTimeMinutes": 0,
                "retentionTimeInMinutes": 0,
            },
        ) as r:
            assert r.status == 201, await r.text()
        for _ in range(40):
            payloads = [rng.randbytes(rng.randrange(1, 3000)) for _ in range(3)]
            async with session.post(
                f"{node.url}/api/v1/streams/{name}/entries",
                data=encode_batch(payloads),
                headers=BATCH,
            ) as r:
                assert r.status == 201, await r.text()
                reply = await r.json()
                for position, payload in zip(batch_positions(reply), payloads, strict=True):
                    entries[position] = payload
        ledgers = sorted({p.ledger_id for p in entries})
        assert len(ledgers) == 40
        # "slow" at the last entry of the 34th ledger: the first 34 go, the 35th on stay.
        cursors = {"slow": Position(ledgers[33], 2), "fast": Position(ledgers[38], 1)}
        for cursor, position in cursors.items():
            base = f"{node.url}/api/v1/streams/{name}/cursors/{cursor}"
            async with session.put(base, json={"start": "earliest"}) as r:
                assert r.status == 201, await r.text()
            async with session.post(f"{base}/ack", json={"position": str(position)}) as r:
                assert r.status == 200, await r.text()
    return RetainedStream(name, entries, ledgers, cursors, keep_from=ledgers[34])


async def _retention_until_killed(node: NodeProcess, kill_after_s: float) -> dict[str, Any] | None:
    async with aiohttp.ClientSession() as session:

        async def run() -> dict[str, Any] | None:
            try:
                async with session.post(f"{node.url}/api/v1/retention/run") as r:
                    assert r.status == 200, await r.text()
                    return dict(await r.json())
            except REPLY_LOST:
                return None

        task = asyncio.create_task(run())
        await asyncio.sleep(kill_after_s)
        await asyncio.to_thread(node.kill)
        return await asyncio.wait_for(task, 60)


def _check_retained(node: NodeProcess, stream: RetainedStream, finished: bool) -> None:
    details = node.get_json(f"/api/v1/streams/{stream.name}")
    all_ids = [info["ledgerId"] for info in details["ledgers"]]
    # A retention run first rolls the full ledger no append comes to: empty ones follow.
    ids = [lid for lid in all_ids if lid <= stream.ledgers[-1]]
    assert all(info["entries"] == 0 for info in details["ledgers"][len(ids) :]), details
    # Retention removes a prefix, and never past the slowest cursor's ledger.
    assert ids == stream.ledgers[len(stream.ledgers) - len(ids) :], (stream.ledgers, ids)
    assert ids[0] <= stream.keep_from
    if finished:
        assert ids[0] == stream.keep_from, "a retention run that finished left ledgers"
    assert http_status(node, f"/api/v1/ledgers/{ids[0]}") == 200, "the first ledger is gone"
    for lid in stream.ledgers[: len(stream.ledgers) - len(ids)]:
        assert http_status(node, f"/api/v1/ledgers/{lid}") == 404, (
            f"ledger {lid} is no longer named by stream {stream.name} yet still exists"
        )
    marks = {c["name"]: pos(c["markDeletePosition"]) for c in details["cursors"]}
    assert set(marks) == set(stream.cursors)
    for cursor, mark in marks.items():
        assert mark.ledger_id in all_ids, (
            f"cursor {cursor}: mark-delete {mark} names a deleted ledger"
        )
        assert mark >= stream.cursors[cursor], f"cursor {cursor} went back to {mark}"
    slowest = min(marks.values())
    found = read_stream(node, stream.name, Position(slowest.ledger_id, slowest.entry_id + 1))
    expected = sorted(p for p in stream.entries if p > slowest)
    assert [p for p, _ in found] == expected, "entries after the slowest mark-delete are lost"
    for position, payload in found:
        assert payload == stream.entries[position], f"{position} reads back different bytes"
    # Everything the stream still names reads back too.
    kept = read_stream(node, stream.name, Position(ids[0], 0))
    assert [p for p, _ in kept] == sorted(p for p in stream.entries if p.ledger_id in all_ids)


@pytest.mark.slow
def test_sigkill_during_a_retention_run(tmp_path: Path) -> None:
    rng = random.Random(4242)
    data = tmp_path / "data"
    env = {"NODE_DELETE_COMMIT_LOG_FILES_INTERVAL_MS": "25"}  # ~34 deletions: about 0.85 s
    streams: list[RetainedStream] = []
    interrupted = 0
    for trial in range(RETENTION_TRIALS):
        node = start_node(data, env)
        for stream in streams:
            _check_retained(node, stream, finished=False)
        streams.append(asyncio.run(_prepare_retention(node, f"r{trial}", rng)))
        answer = asyncio.run(_retention_until_killed(node, rng.uniform(0.05, 0.7)))
        interrupted += answer is None
        node = start_node(data, env)
        for stream in streams:
            _check_retained(node, stream, finished=answer is not None)
        node.kill()
    assert interrupted >= RETENTION_TRIALS - 1, "the kills did not land inside retention runs"
    node = start_node(data, env)
    try:
        request = urllib.request.Request(f"{node.url}/api/v1/retention/run", method="POST")
        with urllib.request.urlopen(request, timeout=60) as r:  # finishes what was left
            assert r.status == 200
        for stream in streams:
            _check_retained(node, stream, finished=True)
    finally:
        assert node.terminate() == 0
