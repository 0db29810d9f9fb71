"""A FoundationDB-style crash test: a mixed workload, a nemesis, a checker; the node is a real
process (tests/harness/node.py) killed with SIGKILL.

Workload, several concurrent clients against one node: adds to ledgers (single adds at a
chosen id, appends, batches), fence, close and delete of ledgers and creation of new ones,
ranged and metadata reads, appends to streams (created up front, never concurrently with
appends), cursor reads and acknowledgments, and forced major and minor GCs.

Model: every request is recorded before it is sent. A 2xx reply makes it acknowledged, a
definitive refusal makes it not done, and a request whose reply was lost to the kill is
"maybe": the checker accepts it either way. So are adds answered 503 (a batch may have half
landed) and 404 (the add can land before a delete whose journal record a kill then cuts).
Whatever a read returned during the run was durable (reads stop at the LAC), so it counts as
acknowledged.

Nemesis: SIGKILL at a random moment of each round (seeded), then a restart on the same data
directory and the next round.

Checker, after every restart: acknowledged entries of ledgers not deleted read back byte for
byte and nothing is there that was never sent; a ledger whose delete was acknowledged
answers 404; no LAC went back; a fenced or closed ledger stayed so and a closed ledger kept
its last entry id; acknowledged stream appends read back at their positions; no cursor's
mark-delete went back or past what was sent. What the restarted node shows then settles
each "maybe" for the rounds that follow: it must survive every later kill too.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from node.streams.model import Position
from node.wire import (
    batch_entry_ids,
    batch_positions,
    decode_range,
    decode_stream_frames,
    encode_batch,
)
from tests.harness.clients import BATCH, OCTET, REPLY_LOST, http_status, read_ledger, read_stream
from tests.harness.node import DEFAULT_SETTINGS, NodeProcess

KILL_ROUNDS = 5
ROUND_S = (1.0, 2.5)  # how long the workload runs before the kill
LEDGER_WRITERS = 3
STREAM_APPENDERS = 2
STREAMS = ("orders", "events")
CURSORS = ("c0", "c1")
MIN_WRITABLE = 3  # the lifecycle client creates ledgers when fewer are open
TAG = {"workload": "mixed"}  # the workload's ledgers, told apart from the streams' ones
OPEN, FENCED, CLOSED = 0, 1, 2
STATES = {"open": OPEN, "fenced": FENCED, "closed": CLOSED}
NOTHING = Position(0, -1)  # a cursor created at "earliest" on a stream with no ledger yet
REPLY_TIMEOUT = aiohttp.ClientTimeout(total=60)  # bounds a hang; asserts nothing on speed


class Lost(Exception):
    """The request got no reply."""

    def __init__(self, method: str, path: str, cause: BaseException, node_up: bool) -> None:
        super().__init__(f"{method} {path}: {cause!r}")
        self.node_up = node_up


@dataclass
class LedgerModel:
    ledger_id: int
    acked: dict[int, bytes] = field(default_factory=dict)
    maybe_at: dict[int, bytes] = field(default_factory=dict)  # single adds at a chosen id
    maybe: set[bytes] = field(default_factory=set)  # appends: the id is the node's choice
    lac: int = -1  # the highest seen in a reply
    state: int = OPEN  # as acknowledged
    maybe_states: set[int] = field(default_factory=set)
    last_entry: int | None = None  # fixed by an acknowledged close
    delete_sent: bool = False
    deleted: bool = False  # acknowledged
    top: int = -1  # the highest entry id known to be taken

    def ack(self, entry_id: int, payload: bytes, lac: int = -1) -> None:
        previous = self.acked.setdefault(entry_id, payload)
        assert previous == payload, f"({self.ledger_id}, {entry_id}) acknowledged twice"
        self.top = max(self.top, entry_id)
        self.lac = max(self.lac, lac)

    def writable(self) -> bool:
        return not self.delete_sent and self.state == OPEN


@dataclass
class CursorModel:
    acked: Position = NOTHING  # the highest acknowledgment answered 200
    sent: Position = NOTHING  # the highest acknowledgment sent


@dataclass
class StreamModel:
    name: str
    acked: dict[Position, bytes] = field(default_factory=dict)
    maybe: set[bytes] = field(default_factory=set)
    cursors: dict[str, CursorModel] = field(default_factory=dict)

    def ack(self, position: Position, payload: bytes) -> None:
        previous = self.acked.setdefault(position, payload)
        assert previous == payload, f"{self.name} {position} acknowledged twice, differently"
        self.maybe.discard(payload)


@dataclass
class Model:
    ledgers: dict[int, LedgerModel] = field(default_factory=dict)
    streams: dict[str, StreamModel] = field(default_factory=dict)
    maybe_creates: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # acknowledged operations, by kind
    serial: itertools.count[int] = field(default_factory=itertools.count)

    def payload(self, rng: random.Random, largest: int) -> bytes:
        """Random bytes behind a serial number: no two payloads are alike, so that an entry
        found by the checker names the one request that can have written it."""
        return f"{next(self.serial):010d}".encode() + rng.randbytes(rng.randrange(0, largest))

    def count(self, kind: str, n: int = 1) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + n

    def writable(self) -> list[LedgerModel]:
        return [m for m in self.ledgers.values() if m.writable()]


class Client:
    def __init__(self, session: aiohttp.ClientSession, url: str, killing: asyncio.Event) -> None:
        self.session = session
        self.url = url
        self.killing = killing

    async def call(self, method: str, path: str, **kwargs: Any) -> tuple[int, bytes]:
        try:
            async with self.session.request(method, f"{self.url}{path}", **kwargs) as r:
                return r.status, await r.read()
        except REPLY_LOST as e:
            raise Lost(method, path, e, node_up=not self.killing.is_set()) from e


def _expect(status: int, body: bytes, allowed: set[int], what: str) -> None:
    assert status in allowed, f"{what}: {status} {body[:300]!r}"


# --- workload -------------------------------------------------------------------------------


async def _add(c: Client, model: Model, rng: random.Random, ledger: LedgerModel) -> None:
    """A single add at the next id, an append or a batch, on an open ledger."""
    path = f"/api/v1/ledgers/{ledger.ledger_id}/entries"
    kind = rng.random()
    if kind < 0.35:
        entry_id = ledger.top = ledger.top + 1
        payload = model.payload(rng, 16 * 1024)
        ledger.maybe_at[entry_id] = payload
        status, body = await c.call("PUT", f"{path}/{entry_id}", data=payload, headers=OCTET)
        _expect(status, body, {201, 409, 503} | ({404} if ledger.delete_sent else set()), path)
        if status in (201, 409):  # 409: fenced, closed, or the id taken; not written
            ledger.maybe_at.pop(entry_id, None)  # (a read may have settled it already)
        if status == 201:
            ledger.ack(entry_id, payload, json.loads(body)["lac"])
            model.count("add")
        return
    if kind < 0.7:
        payloads = [model.payload(rng, 16 * 1024)]
        data, headers = payloads[0], OCTET
    else:
        payloads = [model.payload(rng, 4096) for _ in range(rng.randrange(1, 16))]
        data, headers = encode_batch(payloads), BATCH
    ledger.maybe.update(payloads)
    status, body = await c.call("POST", path, data=data, headers=headers)
    _expect(status, body, {201, 409, 503} | ({404} if ledger.delete_sent else set()), path)
    if status in (201, 409):
        ledger.maybe.difference_update(payloads)
    if status == 201:
        reply = json.loads(body)
        ids = batch_entry_ids(reply) if headers is BATCH else [reply["entryId"]]
        for entry_id, payload in zip(ids, payloads, strict=True):
            ledger.ack(entry_id, payload, reply["lac"])
        model.count("add", len(ids))


async def _ledger_writer(c: Client, model: Model, rng: random.Random) -> None:
    while not c.killing.is_set():
        writable = model.writable()
        if not writable:
            await asyncio.sleep(0.01)
            continue
        await _add(c, model, rng, rng.choice(writable))


async def _lifecycle(c: Client, model: Model, rng: random.Random) -> None:
    """Creates ledgers, and fences, closes and deletes them while adds go on."""
    while not c.killing.is_set():
        await asyncio.sleep(rng.uniform(0.05, 0.25))
        live = [m for m in model.ledgers.values() if not m.delete_sent]
        writable = model.writable()
        choice = rng.random()
        if len(writable) < MIN_WRITABLE or choice < 0.25:
            model.maybe_creates += 1
            status, body = await c.call("POST", "/api/v1/ledgers", json={"properties": TAG})
            _expect(status, body, {201}, "create")
            model.maybe_creates -= 1
            ledger_id = json.loads(body)["ledgerId"]
            assert ledger_id not in model.ledgers, f"ledger id {ledger_id} handed out twice"
            model.ledgers[ledger_id] = LedgerModel(ledger_id)
            model.count("create")
        elif choice < 0.7:
            ledger = rng.choice(writable if choice < 0.45 else live)
            op = "fence" if choice < 0.45 else "close"
            wanted = FENCED if op == "fence" else CLOSED
            ledger.maybe_states.add(wanted)
            path = f"/api/v1/ledgers/{ledger.ledger_id}/{op}"
            status, body = await c.call("POST", path)
            _expect(status, body, {200}, path)
            ledger.maybe_states.discard(wanted)
            # The reply's state may show a concurrent close not yet journaled: only what
            # this request asked for is acknowledged.
            ledger.state = max(ledger.state, wanted)
            meta = json.loads(body)
            ledger.lac = max(ledger.lac, meta["lac"])
            if op == "close":
                assert ledger.last_entry in (None, meta["lastEntryId"]), (
                    f"ledger {ledger.ledger_id} closed again at another last entry: {meta}"
                )
                ledger.last_entry = meta["lastEntryId"]
            model.count(op)
        else:
            ledger = rng.choice(live)
            ledger.delete_sent = True
            path = f"/api/v1/ledgers/{ledger.ledger_id}"
            status, body = await c.call("DELETE", path)
            _expect(status, body, {204}, path)
            ledger.deleted = True
            model.count("delete")


async def _ledger_reader(c: Client, model: Model, rng: random.Random) -> None:
    """Metadata and the last entries of a ledger: the LACs seen, and entries that were
    readable, hence durable, whatever became of their adds' replies."""
    while not c.killing.is_set():
        await asyncio.sleep(rng.uniform(0.02, 0.08))
        candidates = [m for m in model.ledgers.values() if not m.delete_sent]
        if not candidates:
            continue
        ledger = rng.choice(candidates)
        path = f"/api/v1/ledgers/{ledger.ledger_id}"
        try:
            status, body = await c.call("GET", path)
            _expect(status, body, {200} | ({404} if ledger.delete_sent else set()), path)
            if status == 404:
                continue
            ledger.lac = max(ledger.lac, json.loads(body)["lac"])
            first = max(0, ledger.top - 20)
            status, body = await c.call("GET", f"{path}/entries?from={first}")
        except Lost as e:
            if e.node_up and ledger.delete_sent:
                continue  # a range read cut short by a delete that came meanwhile
            raise
        _expect(status, body, {200} | ({404} if ledger.delete_sent else set()), path)
        if status == 404:
            continue
        for entry_id, payload in decode_range(body):
            assert ledger.acked.get(entry_id, payload) == payload, (
                f"({ledger.ledger_id}, {entry_id}) reads back other bytes than acknowledged"
            )
            assert (
                ledger.maybe_at.get(entry_id) == payload
                or payload in ledger.maybe
                or (entry_id in ledger.acked)
            ), f"({ledger.ledger_id}, {entry_id}) holds bytes no add sent there"
            ledger.maybe.discard(payload)
            ledger.maybe_at.pop(entry_id, None)
            ledger.ack(entry_id, payload)


async def _stream_appender(c: Client, model: Model, rng: random.Random) -> None:
    while not c.killing.is_set():
        stream = model.streams[rng.choice(STREAMS)]
        path = f"/api/v1/streams/{stream.name}/entries"
        if rng.random() < 0.6:
            payloads = [model.payload(rng, 8192)]
            data, headers = payloads[0], OCTET
        else:
            payloads = [model.payload(rng, 2048) for _ in range(rng.randrange(1, 8))]
            data, headers = encode_batch(payloads), BATCH
        stream.maybe.update(payloads)
        status, body = await c.call("POST", path, data=data, headers=headers)
        # 409: every attempt landed on a ledger a rollover had closed; nothing was written.
        _expect(status, body, {201, 409, 503}, path)
        if status == 409:
            stream.maybe.difference_update(payloads)
        if status == 201:
            reply = json.loads(body)
            positions = (
                batch_positions(reply) if headers is BATCH else [Position.parse(reply["position"])]
            )
            for position, payload in zip(positions, payloads, strict=True):
                stream.ack(position, payload)
            model.count("stream append", len(payloads))


def _seen_in_stream(stream: StreamModel, position: Position, payload: bytes) -> None:
    if position in stream.acked:
        assert stream.acked[position] == payload, f"{stream.name} {position} reads back other bytes"
    else:
        assert payload in stream.maybe, f"{stream.name} {position} holds bytes never appended"
        stream.ack(position, payload)


async def _consumer(
    c: Client, model: Model, rng: random.Random, stream: StreamModel, name: str
) -> None:
    """Reads through a cursor and acknowledges some position of what it read."""
    cursor = stream.cursors[name]
    base = f"/api/v1/streams/{stream.name}/cursors/{name}"
    while not c.killing.is_set():
        status, body = await c.call("GET", f"{base}/entries?limit=50&waitMs=200")
        _expect(status, body, {200}, base)
        frames = decode_stream_frames(body)
        for position, payload in frames:
            assert position > cursor.acked, f"{base} read {position}, at or before its mark"
            _seen_in_stream(stream, position, payload)
        if not frames or rng.random() < 0.2:
            continue
        position = rng.choice(frames)[0]
        cursor.sent = max(cursor.sent, position)
        status, body = await c.call("POST", f"{base}/ack", json={"position": str(position)})
        _expect(status, body, {200}, f"{base}/ack")
        mark = Position.parse(json.loads(body)["markDeletePosition"])
        assert mark >= position, f"{base}: acknowledged {position}, mark-delete {mark}"
        cursor.acked = max(cursor.acked, position)
        model.count("cursor ack")


async def _gc(c: Client, model: Model, rng: random.Random) -> None:
    while not c.killing.is_set():
        await asyncio.sleep(rng.uniform(0.2, 0.8))
        force = rng.choice(({"forceMajor": True}, {"forceMinor": True}))
        status, body = await c.call("PUT", "/api/v1/bookie/gc", json=force)
        _expect(status, body, {200}, "gc")
        model.count("gc")


Task = Callable[[Client, Model, random.Random], Awaitable[None]]


async def _until_killed(c: Client, task: Task, model: Model, rng: random.Random) -> None:
    """Runs a client until the node is gone; a reply lost while it was up is a failure."""
    try:
        await task(c, model, rng)
    except Lost as e:
        if e.node_up:
            raise AssertionError(f"no reply while the node was up: {e}") from e


async def _round(node: NodeProcess, model: Model, rng: random.Random, kill_after_s: float) -> None:
    killing = asyncio.Event()
    async with aiohttp.ClientSession(timeout=REPLY_TIMEOUT) as session:
        c = Client(session, node.url, killing)
        tasks: list[tuple[Task, random.Random]] = [
            *[(_ledger_writer, random.Random(rng.random())) for _ in range(LEDGER_WRITERS)],
            *[(_stream_appender, random.Random(rng.random())) for _ in range(STREAM_APPENDERS)],
            (_lifecycle, random.Random(rng.random())),
            (_ledger_reader, random.Random(rng.random())),
            (_gc, random.Random(rng.random())),
        ]
        for stream in model.streams.values():
            for name in stream.cursors:
                consume = functools.partial(_consumer, stream=stream, name=name)
                tasks.append((consume, random.Random(rng.random())))
        running = [asyncio.create_task(_until_killed(c, t, model, r)) for t, r in tasks]
        try:
            done, _ = await asyncio.wait(running, timeout=kill_after_s)
            for task in done:
                task.result()  # a client that stopped before the kill found something wrong
            killing.set()
            await asyncio.to_thread(node.kill)
            done, _ = await asyncio.wait(running, timeout=60)
            assert len(done) == len(running), "clients did not stop after the node died"
            for task in done:
                task.result()
        finally:
            killing.set()  # on a failure, the others stop without reporting more
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)


async def _set_up_streams(node: NodeProcess, model: Model) -> None:
    """Streams and their cursors exist before any append (a stream created while appends
    to it run is not what this test is about); small ledgers, so that they roll often."""
    policies = {"maxEntriesPerLedger": 20, "minLedgerRolloverTimeMinutes": 0}
    async with aiohttp.ClientSession(timeout=REPLY_TIMEOUT) as session:
        for name in STREAMS:
            async with session.put(f"{node.url}/api/v1/streams/{name}", json=policies) as r:
                assert r.status == 201, await r.text()
            stream = model.streams[name] = StreamModel(name)
            for cursor in CURSORS:
                async with session.put(
                    f"{node.url}/api/v1/streams/{name}/cursors/{cursor}",
                    json={"start": "earliest"},
                ) as r:
                    assert r.status == 201, await r.text()
                stream.cursors[cursor] = CursorModel()


# --- checker --------------------------------------------------------------------------------


def _check_ledger(node: NodeProcess, ledger: LedgerModel) -> None:
    """What the node holds of one ledger agrees with the model; then the model takes what
    the node shows, which is durable from now on."""
    lid = ledger.ledger_id
    status = http_status(node, f"/api/v1/ledgers/{lid}")
    if ledger.deleted or status == 404:
        assert ledger.delete_sent, f"ledger {lid} is gone, yet it was never deleted"
        assert status == 404, f"ledger {lid} is back after its delete was acknowledged"
        for entry_id in sorted(ledger.acked)[:1]:  # nor do its entries come back by id
            path = f"/api/v1/ledgers/{lid}/entries/{entry_id}"
            assert http_status(node, path) == 404, f"({lid}, {entry_id}) of a deleted ledger"
        ledger.deleted = True
        return
    ledger.delete_sent = False  # the delete did not happen: the ledger lives on
    meta = node.get_json(f"/api/v1/ledgers/{lid}")
    assert meta["lac"] >= ledger.lac, f"ledger {lid}: LAC went back from {ledger.lac}: {meta}"
    state = STATES[meta["state"]]
    allowed = {ledger.state} | {s for s in ledger.maybe_states if s > ledger.state}
    assert state in allowed, f"ledger {lid} is {meta['state']}, acknowledged {ledger.state}"
    if ledger.last_entry is not None:
        assert meta["lastEntryId"] == ledger.last_entry, (
            f"closed ledger {lid}: last entry {ledger.last_entry} became {meta['lastEntryId']}"
        )
    stored = read_ledger(node, lid)
    lost = sorted(set(ledger.acked) - set(stored))
    assert not lost, f"ledger {lid}: acknowledged entries lost: {lost[:10]}"
    for entry_id, payload in stored.items():
        if entry_id in ledger.acked:
            assert payload == ledger.acked[entry_id], f"({lid}, {entry_id}) reads back other bytes"
        else:
            assert ledger.maybe_at.get(entry_id) == payload or payload in ledger.maybe, (
                f"({lid}, {entry_id}) holds bytes that no add sent there"
            )
    assert max(stored, default=-1) <= meta["lastEntryId"], f"ledger {lid}: entries past its end"
    # Single reads take the cache and entry log path, not the range's.
    for entry_id in random.Random(lid).sample(sorted(stored), min(3, len(stored))):
        assert node.get_bytes(f"/api/v1/ledgers/{lid}/entries/{entry_id}") == stored[entry_id]
    ledger.acked = stored
    ledger.maybe_at.clear()
    ledger.maybe.clear()
    ledger.lac = meta["lac"]
    ledger.state = state
    ledger.maybe_states.clear()
    ledger.top = meta["lastEntryId"]
    if state == CLOSED:
        ledger.last_entry = meta["lastEntryId"]


def _check_stream(node: NodeProcess, stream: StreamModel) -> None:
    details = node.get_json(f"/api/v1/streams/{stream.name}")
    ids = [info["ledgerId"] for info in details["ledgers"]]
    assert ids == sorted(set(ids)), f"{stream.name}: ledgers out of order: {ids}"
    stored = read_stream(node, stream.name, Position(ids[0], 0)) if ids else []
    positions = [p for p, _ in stored]
    assert positions == sorted(set(positions)), f"{stream.name}: positions do not increase"
    found = dict(stored)
    lost = sorted(set(stream.acked) - set(found))
    assert not lost, f"{stream.name}: acknowledged appends lost: {[str(p) for p in lost[:10]]}"
    for position, payload in stored:
        _seen_in_stream(stream, position, payload)
    for position in random.Random(len(found)).sample(positions, min(3, len(positions))):
        body = node.get_bytes(f"/api/v1/streams/{stream.name}/entries?from={position}&limit=1")
        assert decode_stream_frames(body) == [(position, found[position])]
    stream.maybe.clear()
    marks = {c["name"]: Position.parse(c["markDeletePosition"]) for c in details["cursors"]}
    assert set(marks) == set(stream.cursors), f"{stream.name}: cursors {sorted(marks)}"
    for name, cursor in stream.cursors.items():
        mark = marks[name]
        assert mark >= cursor.acked, (
            f"{stream.name}/{name}: {cursor.acked} was acknowledged, the mark-delete is {mark}"
        )
        assert mark <= cursor.sent, f"{stream.name}/{name}: mark-delete {mark} never sent"
        cursor.acked = cursor.sent = mark


def _check(node: NodeProcess, model: Model) -> None:
    for ledger in model.ledgers.values():
        _check_ledger(node, ledger)
    # A create whose reply was lost may have made a ledger nobody knows: empty, then.
    unknown = [
        m
        for m in node.get_json("/api/v1/ledgers")["ledgers"]
        if m["properties"] == TAG and m["ledgerId"] not in model.ledgers
    ]
    assert len(unknown) <= model.maybe_creates, f"ledgers nobody created: {unknown}"
    for meta in unknown:
        assert meta["entries"] == 0, f"a ledger nobody knew of has entries: {meta}"
        model.ledgers[meta["ledgerId"]] = LedgerModel(meta["ledgerId"], state=STATES[meta["state"]])
    model.maybe_creates = 0
    for stream in model.streams.values():
        _check_stream(node, stream)


def _start(data: Path, env: dict[str, str] | None) -> NodeProcess:
    node = NodeProcess(data, env)
    node.start()
    return node


def mixed_workload(data: Path, seed: int, env: dict[str, str] | None = None) -> None:
    rng = random.Random(seed)
    model = Model()
    node = _start(data, env)
    asyncio.run(_set_up_streams(node, model))
    for _ in range(KILL_ROUNDS):
        asyncio.run(_round(node, model, rng, kill_after_s=rng.uniform(*ROUND_S)))
        node = _start(data, env)
        _check(node, model)
    _check(node, model)  # a second look: settling the maybes changed nothing on disk
    assert node.terminate() == 0
    node = _start(data, env)
    _check(node, model)  # and a clean stop keeps it all
    assert node.terminate() == 0
    for kind in ("add", "stream append", "cursor ack", "create", "fence", "close", "delete", "gc"):
        assert model.counts.get(kind, 0) >= 3, f"too few acknowledged {kind}s: {model.counts}"


@pytest.mark.slow
def test_mixed_workload_with_churn(tmp_path: Path) -> None:
    """Frequent checkpoints, journal rotations and entry log rolls (CHURN_SETTINGS)."""
    mixed_workload(tmp_path / "data", seed=20261207)


@pytest.mark.slow
def test_mixed_workload_with_defaults(tmp_path: Path) -> None:
    """The node's default settings: checkpoints are rare, so recovery is mostly replay."""
    mixed_workload(tmp_path / "data", seed=20261208, env=DEFAULT_SETTINGS)
