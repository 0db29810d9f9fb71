"""A stream's fault run over plain HTTP: writers append unique payloads through any node of the
fleet, every operation goes into a history (history.py's format), and at the end a cursor
reads the whole stream back; ``check_stream`` compares the two.

Operations are ``append`` (one entry) and ``append_batch``; ``ledger``/``entry`` of an ok one
are the position ``L:E`` the node acknowledged (a batch: its first; its entries follow at
consecutive entry ids of that ledger), ``digest`` the payload's (a batch: one per entry).
Outcomes:

- ``ok``: 201, with the position(s);
- ``fail``: the stream certainly holds none of it: any 4xx, a refused connection (no byte
  was sent), or a 503 whose code says the request was turned away (``DEFINITE_CODES``; an
  owner that lost the stream while its add was fenced may have left the bytes on its own
  replica, past the end recovery gave the ledger, where no read reaches);
- ``info`` (unknown): a timeout, a connection lost after the request was sent, 503
  ``append_outcome_unknown`` (an owner whose adds were fenced), any other 5xx.

A retry is a new operation with new payloads, so a payload names its operation; except with
``producers`` (message deduplication, node/streams/dedup.py): each writer is a producer
(``X-Producer-Id`` its process name) numbering its entries (``X-Sequence-Id``), and retries
every operation that was not acknowledged with the same payloads and ids until it is (a 4xx
ends it: refused for good); an answer 200 ``X-Duplicate: true`` is ``ok`` at the position it
names. Then a payload names its entry, retries included: exactly-once means each is in the
stream once, where every acknowledgment of it said, and ``check_stream`` sees that (a
retried append's invocation is its first one's).

Readers run beside the writers (``cursor_readers``, ``plain_readers``): a cursor reader
creates its cursor at the earliest entry, reads (``cursor_read``), acknowledges the last entry
it got (``cursor_ack``; now and then not, so the next read gets the same entries again) and
now and then resets the cursor to an entry it read before (``cursor_reset``); a plain reader
reads on from the ``X-Next-Position`` of its last read, now and then from the start
(``stream_read``, ``ledger``/``entry`` its ``from``). A read's ``positions`` and digests are
what it got, ``last`` its limit.

``check_stream`` lists every violation (``KINDS``); ``info`` appends, and appends whose
process died before the answer (``unfinished``), may be present (once) or absent. The
entries the final cursor read back are the stream: what a reader got during the run is
judged against them.
``check_stream_ledgers`` goes one level down: the closed ledgers of the stream, read from
their replicas by fresh clients, are checked by the replicated ledgers' checker (checker.py)
against the acknowledged appends and what the cursor read (a deduplicating stream's entries
behind their producer header, taken off with node/streams/dedup.py's decoder).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from node.jepsen.checker import Verdict, Violation, check_cluster
from node.jepsen.history import History, Op, OpFunction, OpType, digest, merge
from node.streams.dedup import ENVELOPE_MARK, ENVELOPE_PROPERTY, BadEnvelope, strip_envelope
from node.streams.model import Position
from node.wire import (
    BATCH_CONTENT_TYPE,
    OCTET_CONTENT_TYPE,
    decode_stream_frames,
    encode_batch,
)

# 503 codes of refusals made before the request was handled: nothing of it was written. An
# append answered owner_unreachable never reached the owner (no connection was made: once
# it was sent, the forwarding node answers append_outcome_unknown).
DEFINITE_CODES = frozenset({"not_owner", "owner_unreachable", "overloaded", "too_many_connections"})
APPEND_TIMEOUT_S = 15.0  # one append, forwarding and a takeover included; past it: unknown
READ_LIMIT = 1000  # entries per cursor read of ``read_back``
READ_ATTEMPTS = 20  # a read or ack of ``read_back`` answered 503 or cut is tried again ...
READ_RETRY_S = 0.5  # ... after this pause (an owner being replaced answers 503 for a while)
READ_TIMEOUT_S = 30.0  # one read or ack of ``read_back``
POLL_S = 0.02  # between two looks at the acknowledged count (``wait_acked``)
# A writer's pause after an append that was not acknowledged: without an owner (a lease
# running out) every node refuses at once, and writers that go on at full speed only fill the
# history and the nodes' logs with refusals.
RETRY_PAUSE_S = 0.05
READ_BACK = "read-back"  # the process of check_stream_ledgers' adds of what the cursor read
RUN_READ_LIMIT = 20  # entries of a reader's read during the run (small: many reads)
READER_PAUSE_S = 0.02  # between two operations of a reader
SKIP_ACK_SHARE = 0.2  # of a cursor reader's reads it does not acknowledge
RESET_SHARE = 0.05  # of a cursor reader's rounds that reset it to an entry it read before
RESTART_SHARE = 0.05  # of a plain reader's reads that start from the stream's first entry
STREAM_READS = ("stream_read", "cursor_read")

KINDS = {
    "lost": "an acknowledged append is not in the stream",
    "position": "an acknowledged append is in the stream, at another position than acknowledged",
    "duplicate": "a payload is in the stream more than once",
    "phantom": "a payload no append of the history carried is in the stream",
    "failed_present": "the payload of an append that failed (for certain) is in the stream",
    "order": "positions read back do not increase strictly (ledger id, then entry id)",
    "twice": "two acknowledged appends were given the same position",
    "writer_order": "a writer's acknowledged appends are not in its invocation order",
    "realtime": "an append acknowledged before another was invoked has a later position",
    "read_mismatch": "a read got other bytes at a position than the stream (or the ack) has",
    "dirty_read": "a read got an entry at a position the stream does not keep",
    "skip": "a read (or a cursor's next read) passed over entries of the stream",
    "read_twice": "a cursor's read got again an entry its acknowledgment had passed",
    "stale_read": "a read left out an entry whose append was acknowledged before it began",
}


def _position(text: str) -> Position:
    return Position.parse(text)


@dataclass
class StreamWorkload:
    """``writers`` tasks, each appending one entry or a batch of 1..``batch_max`` at a time,
    its next operation after the last one's answer, each sent to the next URL of ``urls``
    (round-robin over every writer's operations; a test may replace ``urls`` while it runs,
    e.g. to stop sending to a node it killed). Process names are ``<prefix><i>``; payloads
    ``<prefix><i>-<n>``, unique as long as two workloads on a stream have distinct prefixes."""

    urls: list[str]
    stream: str
    writers: int = 3
    batch_max: int = 1
    prefix: str = "w"
    seed: int = 0
    timeout_s: float = APPEND_TIMEOUT_S
    pause_s: float = 0.0  # between two operations of a writer
    retry_pause_s: float = RETRY_PAUSE_S  # after an operation that was not ok
    cursor_readers: int = 0  # each with its own cursor, named after its process
    plain_readers: int = 0
    producers: bool = False  # writers are producers, retrying with the same ids (docstring)
    read_limit: int = RUN_READ_LIMIT
    histories: list[History] = field(init=False)
    readers: list[History] = field(init=False)
    outcomes: dict[str, int] = field(init=False, default_factory=dict)  # "201", "503 code", ...
    acked: int = field(init=False, default=0)  # ok operations so far
    _turn: int = field(init=False, default=0)
    _counts: list[int] = field(init=False)
    _sequences: list[int] = field(init=False)  # each producer's next sequence id
    _running: bool = field(init=False, default=False)
    _tasks: list[asyncio.Task[None]] = field(init=False, default_factory=list)
    _reader_tasks: list[asyncio.Task[None]] = field(init=False, default_factory=list)
    _session: aiohttp.ClientSession | None = field(init=False, default=None)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.histories = [History(f"{self.prefix}{i}") for i in range(self.writers)]
        self.readers = [History(f"{self.prefix}c{i}") for i in range(self.cursor_readers)]
        self.readers += [History(f"{self.prefix}r{i}") for i in range(self.plain_readers)]
        self._counts = [0] * self.writers
        self._sequences = [0] * self.writers
        self._rng = random.Random(self.seed)

    def history(self) -> list[Op]:
        """Every writer's and reader's operations, in time order."""
        return merge(*(h.ops for h in self.histories + self.readers))

    def next_url(self) -> str:
        url = self.urls[self._turn % len(self.urls)]
        self._turn += 1
        return url

    def _payload(self, writer: int) -> bytes:
        self._counts[writer] += 1
        return f"{self.prefix}{writer}-{self._counts[writer]}".encode()

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No pooled connection outlives a node's kill: every append opens its own, so a
            # refused connection is told apart from one cut after the request went out.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        return self._session

    async def append(
        self,
        writer: int,
        entries: int = 1,
        url: str | None = None,
        again: tuple[list[bytes], int] | None = None,
    ) -> Op:
        """One operation of writer ``writer`` (``entries`` > 1: a batch) to ``url`` (default:
        the next of ``urls``), logged; its completion. ``again``: the payloads and first
        sequence id of a producer's operation sent before (``producers``)."""
        history = self.histories[writer]
        if again is not None:
            payloads, sequence = again
        else:
            payloads = [self._payload(writer) for _ in range(entries)]
            sequence = self._sequences[writer]
            self._sequences[writer] += entries
        entries = len(payloads)
        digests = [digest(p) for p in payloads]
        f: OpFunction = "append" if entries == 1 else "append_batch"
        logged: str | list[str] = digests[0] if entries == 1 else digests
        if entries == 1:
            body, content_type = payloads[0], OCTET_CONTENT_TYPE
        else:
            body, content_type = encode_batch(payloads), BATCH_CONTENT_TYPE
        target = url or self.next_url()
        headers = {"Content-Type": content_type}
        if self.producers:
            headers |= {"X-Producer-Id": history.process, "X-Sequence-Id": str(sequence)}
        history.log("invoke", f, None, None, logged)
        outcome: OpType
        try:
            async with self._open().post(
                f"{target}/api/v1/streams/{self.stream}/entries",
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as response:
                raw = await response.read()
                status = response.status
                duplicate = response.headers.get("X-Duplicate") == "true"
        except aiohttp.ClientConnectorError:
            self._count("refused")
            return history.log("fail", f, None, None, logged)
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as error:
            self._count(type(error).__name__)
            return history.log("info", f, None, None, logged)
        if status == 201 or (status == 200 and duplicate):
            reply = json.loads(raw)
            named = reply["position"] if entries == 1 else reply["firstPosition"]
            if named is None:  # a duplicate older than the producer's runs the node keeps
                self._count("200 no position")
                return history.log("info", f, None, None, logged, error="200 no position")
            first = _position(named)
            self._count(str(status))
            self.acked += 1
            return history.log("ok", f, first.ledger_id, first.entry_id, logged)
        code = _code(raw)
        self._count(f"{status} {code}")
        outcome = "fail" if 400 <= status < 500 or code in DEFINITE_CODES else "info"
        return history.log(outcome, f, None, None, logged, error=f"{status} {code}")

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    async def _writer(self, writer: int, operations: int | None) -> None:
        done = 0
        while self._running and (operations is None or done < operations):
            entries = self._rng.randint(1, self.batch_max)
            if self.producers:
                op = await self._until_acked(writer, entries)
            else:
                op = await self.append(writer, entries)
            done += 1
            pause = self.pause_s if op.type == "ok" else max(self.pause_s, self.retry_pause_s)
            if pause:
                await asyncio.sleep(pause)

    async def _until_acked(self, writer: int, entries: int) -> Op:
        """A producer's operation, sent again with the same payloads and sequence ids after
        every answer but an acknowledgment or a 4xx (also after ``stop``: it ends acked)."""
        payloads = [self._payload(writer) for _ in range(entries)]
        first = self._sequences[writer]
        self._sequences[writer] += entries
        op = await self.append(writer, again=(payloads, first))
        while op.type != "ok" and not (op.error or "").startswith("4"):
            await asyncio.sleep(self.retry_pause_s)
            op = await self.append(writer, again=(payloads, first))
        return op

    async def _request(
        self, method: str, url: str, body: Any = None
    ) -> tuple[int, bytes, str | None, str]:
        """(status, body, X-Next-Position, "") or (0, b"", None, why) without an answer."""
        try:
            async with self._open().request(
                method, url, json=body, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as response:
                raw = await response.read()
                return response.status, raw, response.headers.get("X-Next-Position"), ""
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as error:
            return 0, b"", None, type(error).__name__

    async def read(
        self, history: History, url: str, f: OpFunction, at: Position | None = None
    ) -> tuple[Op, str | None]:
        """One read, logged: a cursor's (``cursor_read``: the cursor named after the process)
        or a plain one from ``at``; the operation and the next position to read from."""
        if f == "cursor_read":
            target = f"{url}/api/v1/streams/{self.stream}/cursors/{history.process}/entries"
        else:
            target = f"{url}/api/v1/streams/{self.stream}/entries"
        query = f"?limit={self.read_limit}" + (f"&from={at}" if at is not None else "")
        ledger, entry = _at(at)
        history.log("invoke", f, ledger, entry, last=self.read_limit)
        status, raw, following, why = await self._request("GET", target + query)
        if status != 200:
            error = why or f"{status} {_code(raw)}"
            return history.log("info", f, ledger, entry, last=self.read_limit, error=error), None
        frames = decode_stream_frames(raw)
        op = history.log(
            "ok",
            f,
            ledger,
            entry,
            [digest(payload) for _, payload in frames],
            last=self.read_limit,
            positions=[str(position) for position, _ in frames],
        )
        return op, following

    async def cursor_call(
        self, history: History, url: str, f: OpFunction, at: Position | None = None
    ) -> Op:
        """The cursor's creation (at the earliest entry), an ack or a reset to ``at``, logged:
        ok, fail (4xx: refused) or info."""
        base = f"{url}/api/v1/streams/{self.stream}/cursors/{history.process}"
        ledger, entry = _at(at)
        history.log("invoke", f, ledger, entry)
        if f == "cursor_create":
            answer = await self._request("PUT", base, {"start": "earliest"})
        else:
            path = "ack" if f == "cursor_ack" else "reset"
            answer = await self._request("POST", f"{base}/{path}", {"position": str(at)})
        status, raw, _, why = answer
        if status in (200, 201):
            return history.log("ok", f, ledger, entry)
        outcome: OpType = "fail" if 400 <= status < 500 else "info"
        return history.log(outcome, f, ledger, entry, error=why or f"{status} {_code(raw)}")

    async def _cursor_reader(self, history: History) -> None:
        while self._running:
            if (await self.cursor_call(history, self.next_url(), "cursor_create")).type == "ok":
                break
            await asyncio.sleep(self.retry_pause_s)
        seen: list[Position] = []
        while self._running:
            op, _ = await self.read(history, self.next_url(), "cursor_read")
            got = [_position(p) for p in op.positions or []]
            seen += got
            if got and self._rng.random() >= SKIP_ACK_SHARE:
                await self.cursor_call(history, self.next_url(), "cursor_ack", got[-1])
            if seen and self._rng.random() < RESET_SHARE:
                back = self._rng.choice(seen)
                await self.cursor_call(history, self.next_url(), "cursor_reset", back)
            await asyncio.sleep(READER_PAUSE_S if op.type == "ok" else self.retry_pause_s)

    async def _plain_reader(self, history: History) -> None:
        at: Position | None = None
        while self._running:
            if self._rng.random() < RESTART_SHARE:
                at = None
            op, following = await self.read(history, self.next_url(), "stream_read", at)
            if following is not None:
                at = _position(following)
            await asyncio.sleep(READER_PAUSE_S if op.type == "ok" else self.retry_pause_s)

    def start(self, operations: int | None = None) -> None:
        """Starts the writers (each runs ``operations`` operations, or until ``stop``) and
        the readers (until ``stop``)."""
        self._running = True
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._writer(i, operations)) for i in range(self.writers)]
        self._reader_tasks = [
            loop.create_task(
                self._cursor_reader(h) if i < self.cursor_readers else self._plain_reader(h)
            )
            for i, h in enumerate(self.readers)
        ]

    async def join(self) -> None:
        """Until every writer has ended (its operations done, or ``stop``)."""
        await asyncio.gather(*self._tasks)

    async def stop(self) -> None:
        """No new operation; waits for those in flight (each ends within ``timeout_s``)."""
        self._running = False
        await self.join()
        await asyncio.gather(*self._reader_tasks)

    async def wait_acked(self, count: int, timeout_s: float = 60.0) -> None:
        """Until ``count`` operations in all were acknowledged; AssertionError past
        ``timeout_s``, with the outcomes so far."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.acked < count:
            if loop.time() > deadline or (self._tasks and all(t.done() for t in self._tasks)):
                raise AssertionError(
                    f"{self.acked} of {count} appends acknowledged; outcomes {self.outcomes}"
                )
            await asyncio.sleep(POLL_S)

    async def close(self) -> None:
        self._running = False
        for task in self._tasks + self._reader_tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._reader_tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> StreamWorkload:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _at(position: Position | None) -> tuple[int | None, int | None]:
    return (None, None) if position is None else (position.ledger_id, position.entry_id)


def _code(raw: bytes) -> str:
    """The stable code of an error body, "" when it is not the node's JSON error."""
    try:
        found = json.loads(raw)
    except ValueError:
        return ""
    return str(found.get("code", "")) if isinstance(found, dict) else ""


async def _call(
    session: aiohttp.ClientSession, method: str, url: str, body: Any = None
) -> tuple[int, bytes]:
    """One request of ``read_back``, tried again while the answer is a 503 or lost (a stream
    whose owner is being replaced); the last status and body."""
    status, raw = 0, b""
    for attempt in range(READ_ATTEMPTS):
        if attempt:
            await asyncio.sleep(READ_RETRY_S)
        try:
            async with session.request(
                method, url, json=body, timeout=aiohttp.ClientTimeout(total=READ_TIMEOUT_S)
            ) as response:
                status, raw = response.status, await response.read()
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as error:
            status, raw = 0, str(error).encode()
            continue
        if status != 503:
            return status, raw
    return status, raw


async def read_back(url: str, stream: str, cursor: str = "checker") -> list[tuple[str, bytes]]:
    """Everything a new cursor of ``stream`` reads through the node at ``url`` from the
    earliest entry to the end, in order, as (``L:E``, payload); the cursor acknowledges each
    read's last entry before the next read. RuntimeError when a call keeps failing."""
    base = f"{url}/api/v1/streams/{stream}/cursors/{cursor}"
    found: list[tuple[str, bytes]] = []
    async with aiohttp.ClientSession() as session:
        status, raw = await _call(session, "PUT", base, {"start": "earliest"})
        if status not in (200, 201):
            raise RuntimeError(f"cursor {cursor} of {stream}: {status} {raw[:300]!r}")
        while True:
            status, raw = await _call(session, "GET", f"{base}/entries?limit={READ_LIMIT}")
            if status != 200:
                raise RuntimeError(f"read of {stream} via {url}: {status} {raw[:300]!r}")
            frames = decode_stream_frames(raw)
            if not frames:
                return found
            found.extend((str(position), payload) for position, payload in frames)
            last = str(frames[-1][0])
            status, raw = await _call(session, "POST", f"{base}/ack", {"position": last})
            if status != 200:
                raise RuntimeError(f"ack {last} of {stream} via {url}: {status} {raw[:300]!r}")


@dataclass
class _Append:
    """One completed operation and when it started."""

    op: Op
    invoked: float
    index: int  # among its process's operations

    @property
    def positions(self) -> list[tuple[Position, str]]:
        assert self.op.ledger is not None and self.op.entry is not None
        return [
            (Position(self.op.ledger, self.op.entry + i), d)
            for i, d in enumerate(self.op.digests())
        ]


def _completions(history: Iterable[Op]) -> tuple[list[_Append], int]:
    """Every completed append with its invocation time, and how many were never completed
    (their process died first)."""
    started: dict[tuple[str, tuple[str, ...]], float] = {}
    first: dict[tuple[str, tuple[str, ...]], float] = {}  # a retried one's first invocation
    done: list[_Append] = []
    per_process: dict[str, int] = {}
    for op in history:
        if op.f not in ("append", "append_batch"):
            continue
        key = (op.p, tuple(op.digests()))
        if op.type == "invoke":
            started[key] = op.t
            first.setdefault(key, op.t)
            continue
        index = per_process.get(op.p, 0)
        per_process[op.p] = index + 1
        started.pop(key, None)
        done.append(_Append(op, first.get(key, op.t), index))
    return done, len(started)


def check_stream(
    history: Sequence[Op], read_back: Sequence[tuple[str | Position, bytes]]
) -> Verdict:
    """``read_back``: everything a cursor read of the stream at the end, in order, as
    (position, payload); the module's docstring says what must hold."""
    verdict = Verdict()
    found = verdict.violations

    def bad(kind: str, position: Position, detail: str) -> None:
        found.append(Violation(kind, position.ledger_id, position.entry_id, detail))

    invoked: set[str] = set()
    for op in history:
        if op.f in ("append", "append_batch"):
            invoked.update(op.digests())
    appends, unfinished = _completions(history)
    acked = [a for a in appends if a.op.type == "ok"]
    # A producer's payload may fail once and be acknowledged on a retry (``producers``).
    failed = {d for a in appends if a.op.type == "fail" for d in a.op.digests()} - {
        d for a in acked for d in a.op.digests()
    }
    counts: dict[str, int] = {"ok": 0, "fail": 0, "info": 0}
    for a in appends:
        counts[a.op.type] = counts.get(a.op.type, 0) + 1
    reads = [op for op in history if op.f in STREAM_READS and op.type != "invoke"]
    verdict.counts = {
        **counts,
        "unfinished": unfinished,
        "acked_entries": sum(len(a.op.digests()) for a in acked),
        "read": len(read_back),
        "reads": len(reads),
        "reads_ok": sum(op.type == "ok" for op in reads),
        "read_entries": sum(len(op.digests()) for op in reads),
    }

    read = [
        (p if isinstance(p, Position) else _position(p), digest(payload))
        for p, payload in read_back
    ]
    where: dict[str, list[int]] = {}
    for i, (position, d) in enumerate(read):
        if i and position <= read[i - 1][0]:
            bad("order", position, f"read at index {i} after {read[i - 1][0]}")
        seen = where.setdefault(d, [])
        if seen:
            bad("duplicate", position, f"payload {d} also at {read[seen[0]][0]}")
        seen.append(i)
        if d not in invoked:
            bad("phantom", position, f"payload {d}: no append carried it")
        elif d in failed:
            bad("failed_present", position, f"payload {d} of an append that failed")

    given: dict[Position, str] = {}
    for a in acked:
        for position, d in a.positions:
            if given.setdefault(position, d) != d:
                bad("twice", position, f"acknowledged to {a.op.p} and to another append")
            indexes = where.get(d)
            if not indexes:
                bad("lost", position, f"{a.op.p}'s acknowledged payload {d} was not read back")
            elif read[indexes[0]][0] != position:
                bad("position", position, f"{a.op.p}'s payload {d} read at {read[indexes[0]][0]}")
    _check_writer_order(acked, where, bad)
    _check_realtime(acked, bad)
    _ReadJudge(history, read, acked, invoked, bad).judge()
    return verdict


@dataclass
class _Cursor:
    """Where a cursor reader's cursor may be, as indexes into the final stream of its
    mark-delete (the entry before the next one it reads). An ack or a reset of unknown
    outcome may take effect at any time after it was sent, even after later ones answered
    (a request stuck in a paused node): it stays pending for good. ``marks`` None: somewhere
    the final stream does not name (an ack of an entry it does not keep)."""

    marks: set[int] | None = field(default_factory=set)
    acks: set[int] = field(default_factory=set)  # pending: each moves it forward to there
    resets: set[int] = field(default_factory=set)  # pending: each puts it there

    def candidates(self) -> set[int] | None:
        if self.marks is None:
            return None
        base = self.marks | self.resets
        return base | {max(m, ack) for m in base for ack in self.acks}

    def move(self, f: OpFunction, mark: int | None, certain: bool) -> None:
        if mark is None:
            self.marks = None
        elif not certain:
            (self.acks if f == "cursor_ack" else self.resets).add(mark)
        elif f == "cursor_ack":  # an acknowledgment never moves a cursor back
            now = self.candidates()
            self.marks = None if now is None else {max(m, mark) for m in now or {mark}}
        else:  # created at the earliest entry, or reset
            self.marks = {mark}


class _ReadJudge:
    """The reads of the run against the stream as read back at the end (``final``): what
    each got, where each began (a cursor's read: after one of its ``_Cursor.candidates``)
    and whether it left out entries acknowledged before it began."""

    def __init__(
        self,
        history: Sequence[Op],
        final: list[tuple[Position, str]],
        acked: list[_Append],
        invoked: set[str],
        bad: Any,
    ) -> None:
        self.history = history
        self.final = final
        self.index = {position: i for i, (position, _) in enumerate(final)}
        self.acked = {p: d for a in acked for p, d in a.positions}
        # (when acknowledged, the highest index of its entries in final), by completion
        self.done = sorted(
            (a.op.t, max(self.index.get(p, -1) for p, _ in a.positions)) for a in acked
        )
        self.invoked = invoked
        self.bad = bad

    def judge(self) -> None:
        started: dict[str, float] = {}
        cursors: dict[str, _Cursor] = {}
        for op in self.history:
            if op.type == "invoke":
                started[op.p] = op.t
                continue
            if op.f in ("cursor_create", "cursor_ack", "cursor_reset") and op.type != "fail":
                cursors.setdefault(op.p, _Cursor()).move(op.f, self._mark(op), op.type == "ok")
            elif op.f in STREAM_READS and op.type == "ok":
                got = self._entries(op)
                if op.f == "stream_read":
                    at = None if op.ledger is None else Position(op.ledger, op.entry or 0)
                    begin: set[int] | None = {self._first_at(at)}
                else:
                    found = cursors.setdefault(op.p, _Cursor()).candidates()
                    begin = {m + 1 for m in found} if found else None
                self._judge_read(op, got, begin, started.get(op.p, op.t))

    def _first_at(self, at: Position | None) -> int:
        """The index in ``final`` of the first entry at ``at`` or after it."""
        if at is None:
            return 0
        return next((i for i, (p, _) in enumerate(self.final) if p >= at), len(self.final))

    def _mark(self, op: Op) -> int | None:
        """The mark-delete ``op`` sets (an ack: at most), None where the stream has no entry."""
        if op.f == "cursor_create":
            return -1  # at the earliest entry: before the first
        i = None if op.ledger is None else self.index.get(Position(op.ledger, op.entry or 0))
        if i is None:
            return None
        return i if op.f == "cursor_ack" else i - 1

    def _entries(self, op: Op) -> list[tuple[Position, str]]:
        positions = [_position(p) for p in op.positions or []]
        return list(zip(positions, op.digests(), strict=True))

    def _judge_read(
        self, op: Op, got: list[tuple[Position, str]], begin: set[int] | None, started: float
    ) -> None:
        name = f"{op.p}'s {op.f}"
        indexes: list[int] = []
        for position, d in got:
            i = self.index.get(position)
            acked = self.acked.get(position)
            if d not in self.invoked:
                self.bad("phantom", position, f"{name} got {d}: no append carried it")
            if acked is not None and acked != d:
                self.bad("read_mismatch", position, f"{name} got {d}, {acked} was acknowledged")
            if i is None:
                self.bad("dirty_read", position, f"{name} got {d}; the stream has no entry there")
                continue
            if self.final[i][1] != d:
                self.bad("read_mismatch", position, f"{name} got {d}, the stream has another")
            indexes.append(i)
        for before, after in itertools.pairwise(indexes):
            if after <= before:
                self.bad("order", self.final[after][0], f"{name} got it after a later entry")
            elif after > before + 1:
                self.bad("skip", self.final[before + 1][0], f"{name} passed over it")
        if begin is None or len(indexes) != len(got):
            return  # where it should begin is not known (or it got entries named already)
        if indexes and indexes[0] not in begin:
            first = self.final[indexes[0]][0]
            if indexes[0] > max(begin):
                skipped = self.final[max(begin)][0]
                self.bad("skip", skipped, f"{name} began at {first}, after it")
            elif op.f == "cursor_read":
                self.bad("read_twice", first, f"{name}: its cursor had been acknowledged past it")
            else:
                self.bad("order", first, f"{name} from {op.ledger}:{op.entry} began before it")
        self._judge_stale(op, name, len(indexes), max(begin), started)

    def _judge_stale(self, op: Op, name: str, count: int, begin: int, started: float) -> None:
        """A read gets every entry from where it begins up to its limit that the stream held
        once an append acknowledged before the read began had landed."""
        highest = max((i for t, i in self.done if t < started), default=-1)
        limit = op.last if op.last is not None else count
        owed = min(limit, highest - begin + 1)
        if count < owed:
            missing = self.final[begin + count][0]
            self.bad("stale_read", missing, f"{name} got {count} entries, {owed} were there")


def _check_writer_order(acked: list[_Append], where: dict[str, list[int]], bad: Any) -> None:
    """A writer's ops run one after the other: their positions, acknowledged and read back,
    follow its invocation order."""
    by_process: dict[str, list[_Append]] = {}
    for a in acked:
        by_process.setdefault(a.op.p, []).append(a)
    for process, ops in by_process.items():
        ops.sort(key=lambda a: a.index)
        last_acked: Position | None = None
        last_read = -1
        for a in ops:
            positions = a.positions
            if last_acked is not None and positions[0][0] <= last_acked:
                bad("writer_order", positions[0][0], f"{process} acknowledged after {last_acked}")
            last_acked = positions[-1][0]
            for position, d in positions:
                indexes = where.get(d)
                if not indexes:
                    continue  # lost: named already
                if indexes[0] <= last_read:
                    bad(
                        "writer_order",
                        position,
                        f"{process}'s payload {d} read before an earlier one",
                    )
                last_read = indexes[0]


def _check_realtime(acked: list[_Append], bad: Any) -> None:
    """An append acknowledged before another was invoked has the earlier position (whatever
    nodes they went through): appends are linearizable."""
    by_end = sorted(acked, key=lambda a: a.op.t)
    highest: tuple[Position, _Append] | None = None
    i = 0
    for a in sorted(acked, key=lambda a: a.invoked):
        while i < len(by_end) and by_end[i].op.t < a.invoked:
            last = by_end[i].positions[-1][0]
            if highest is None or last > highest[0]:
                highest = (last, by_end[i])
            i += 1
        first = a.positions[0][0]
        if highest is not None and first <= highest[0]:
            before = highest[1].op
            bad(
                "realtime",
                first,
                f"{a.op.p}'s append invoked after {before.p}'s was acknowledged at {highest[0]}",
            )


def as_ledger_history(
    history: Iterable[Op], read_back: Iterable[tuple[str | Position, bytes]], ledgers: set[int]
) -> list[Op]:
    """The stream's history as the ledger checker's, for ``ledgers``: each acknowledged append
    an ok add at its position, and each entry the cursor read an add of unknown outcome into
    its ledger (so its bytes are no phantom there, and no rule requires it; bytes the cursor
    did not read are phantoms there); each entry a reader got during the run a read of its
    ledger."""
    ops = [
        Op(READ_BACK, "info", "add", position.ledger_id, None, digest(payload))
        for position, payload in (
            (p if isinstance(p, Position) else _position(p), payload) for p, payload in read_back
        )
        if position.ledger_id in ledgers
    ]
    for op in history:
        if op.type == "ok" and op.ledger in ledgers and op.f in ("append", "append_batch"):
            ops.append(replace(op, f="add" if op.f == "append" else "add_batch"))
        elif op.type == "ok" and op.f in STREAM_READS:
            for text, d in zip(op.positions or [], op.digests(), strict=True):
                position = _position(text)
                if position.ledger_id in ledgers:
                    ops.append(Op(op.p, "ok", "read", position.ledger_id, position.entry_id, d))
    return ops


async def check_stream_ledgers(
    history: Sequence[Op],
    read_back: Sequence[tuple[str | Position, bytes]],
    metadata_url: str,
    closed: set[int],
) -> Verdict:
    """The replicated ledgers' checker on the stream's ``closed`` ledgers: fresh readers agree
    on each one's end, find it CLOSED with no gap, nothing served past its end, every
    acknowledged append at its position and nothing the cursor did not read."""
    ledger_history = as_ledger_history(history, read_back, closed)
    return await check_cluster(
        ledger_history, metadata_url, unplaced=unplaced_appends(history), payload=stored_payload
    )


def stored_payload(meta: Mapping[str, Any]) -> Callable[[bytes], bytes] | None:
    """A deduplicating stream's ledger (marked so in its properties) stores each payload
    behind a producer header (node/streams/dedup.py): the checker compares what is behind
    it. Bytes without the header stay as they are (a digest no append has: a phantom)."""
    if meta.get("properties", {}).get(ENVELOPE_PROPERTY) != ENVELOPE_MARK:
        return None
    return _unwrapped


def _unwrapped(entry: bytes) -> bytes:
    try:
        return strip_envelope(entry)
    except BadEnvelope:
        return entry


def unplaced_appends(history: Iterable[Op]) -> frozenset[str]:
    """Digests of the appends sent more often than acknowledged (``info``, ``fail``, or
    invoked and never answered): their bytes may sit past a closed ledger's end on a replica,
    and the history cannot say in which ledger. A paused owner's add reaches its own copy and
    is fenced at the others: recovery ends the ledger before it, and the owner, no longer the
    owner, turns the append away (``not_owner``: a failure, and a true one, as the stream
    will never hold it). A producer's append (``producers``) sent again with the same payload
    after such an answer, and acknowledged then, counts too: its first attempt's bytes may be
    such a leftover, past another ledger's end."""
    sent: dict[str, int] = {}
    acked: dict[str, int] = {}
    for op in history:
        if op.f in ("append", "append_batch") and op.type in ("invoke", "ok"):
            counts = sent if op.type == "invoke" else acked
            for d in op.digests():
                counts[d] = counts.get(d, 0) + 1
    return frozenset(d for d, n in sent.items() if n > acked.get(d, 0))
