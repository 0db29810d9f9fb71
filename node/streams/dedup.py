"""Message deduplication (Pulsar's MessageDeduplication, PIP-6; Kafka's idempotent producer):
an append that names its producer (``X-Producer-Id``) and numbers itself (``X-Sequence-Id``;
a batch takes consecutive ids from it) lands once, however often the client sends it.

The table: per stream, per producer, the highest sequence id persisted and where its last
``RECENT_RUNS`` runs of appends were stored, so that a retry is answered with the position it
got the first time (200, ``X-Duplicate: true``; nothing is written). Pulsar answers such a
retry without a position; Kafka keeps a producer's last five batches, as many as it may have
in flight: a client with several appends out whose answers were all lost learns each one's
position. An older id (or one a gap skipped) is still a duplicate, answered with no position.

What rebuilds it (a restart, an owner's failover, an append whose outcome the owner lost):
the snapshot (``dedup/<stream>`` beside the stream's record: the table as it was once every
entry up to ``through`` was in it) and the entries after ``through``, each of which carries its
producer and sequence id in a small header (``Envelope``) on a deduplicating stream's ledgers.
Replaying an entry the snapshot already holds changes nothing (ids only grow), so a snapshot
may lag. Retention and offload never need the old ledgers again: a trim writes a fresh
snapshot in the batch that drops them.

Which ledgers carry the header: those created while the stream's ``deduplication`` policy was
on, marked at creation (``LedgerInfo.envelope`` in the stream's record, and the ledger's
``ENVELOPE_PROPERTY``), and every entry of such a ledger has it (an append without producer
headers: an empty producer). Toggling the policy rolls the stream over at its next append.
Readers get the bytes appended, the header stripped.
"""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import dataclass, field

from node.client.producer import DUPLICATE_HEADER, PRODUCER_HEADER, SEQUENCE_HEADER
from node.streams.model import NAME, Position
from node.streams.policies import INT64_MAX

ENVELOPE_PROPERTY = "envelope"  # a ledger property: its entries carry the header below
ENVELOPE_MARK = "producer-v1"  # ... of this version
SNAPSHOT_PREFIX = b"dedup/"  # the snapshot's record key: SNAPSHOT_PREFIX + stream name
# 2: per producer [highest, seen_ms, [[first, last, ledger id, entry id] of each run]];
# 1 (still read): [highest, first, "ledger:entry", seen_ms], one run
SNAPSHOT_VERSION = 2
RECENT_RUNS = 5  # runs of appends whose positions each producer's entry keeps (Kafka: 5)
BEFORE_ALL = Position(0, -1)  # a table with no snapshot: every entry is read


# --- the entry header ------------------------------------------------------------------------
#
# offset  size  field
# 0       1     version (ENVELOPE_VERSION)
# 1       1     n: the producer id's length in bytes; 0: an append without producer headers
# 2       n     the producer id (ASCII, the name alphabet: node.streams.model.NAME)
# 2+n     8     the sequence id, unsigned big-endian, < 2^63 (only when n > 0)
# ...           the payload as appended

ENVELOPE_VERSION = 1
_HEAD = struct.Struct(">BB")
_SEQUENCE = struct.Struct(">Q")
_ANONYMOUS = _HEAD.pack(ENVELOPE_VERSION, 0)


class BadEnvelope(ValueError):
    """An entry of a ledger marked as carrying the header that does not carry it."""


def envelope_head(producer: str | None, sequence: int) -> bytes:
    """The header of an entry of ``producer`` (None: an append without producer headers)."""
    if producer is None:
        return _ANONYMOUS
    name = producer.encode()
    return _HEAD.pack(ENVELOPE_VERSION, len(name)) + name + _SEQUENCE.pack(sequence)


def enveloped(payloads: list[bytes], producer: str | None, first: int) -> list[bytes]:
    """``payloads`` as a deduplicating stream's ledger stores them: the i-th with the header
    of ``producer``'s id ``first + i``. (The producer's part of the header is made once.)"""
    if producer is None:
        return [_ANONYMOUS + payload for payload in payloads]
    name = producer.encode()
    prefix = _HEAD.pack(ENVELOPE_VERSION, len(name)) + name
    pack = _SEQUENCE.pack
    if len(payloads) == 1:  # most appends
        return [prefix + pack(first) + payloads[0]]
    return [prefix + pack(sequence) + payload for sequence, payload in enumerate(payloads, first)]


def open_envelope(entry: bytes) -> tuple[str | None, int, bytes]:
    """(producer or None, sequence id, payload) of an entry written with ``envelope_head``."""
    if len(entry) < _HEAD.size:
        raise BadEnvelope(f"an entry of {len(entry)} bytes has no producer header")
    version, length = _HEAD.unpack_from(entry)
    if version != ENVELOPE_VERSION:
        raise BadEnvelope(f"producer header version {version}, not {ENVELOPE_VERSION}")
    if not length:
        return None, -1, entry[_HEAD.size :]
    end = _HEAD.size + length
    if len(entry) < end + _SEQUENCE.size:
        raise BadEnvelope(f"an entry of {len(entry)} bytes cuts its producer header short")
    (sequence,) = _SEQUENCE.unpack_from(entry, end)
    return entry[_HEAD.size : end].decode(), sequence, entry[end + _SEQUENCE.size :]


def strip_envelope(entry: bytes) -> bytes:
    """The payload of an entry written with ``envelope_head`` (every read of a deduplicating
    stream's ledger: the producer's name is not decoded)."""
    if len(entry) >= _HEAD.size and entry[0] == ENVELOPE_VERSION:
        length = entry[1]
        start = _HEAD.size + length + (_SEQUENCE.size if length else 0)
        if len(entry) >= start:
            return entry[start:]
    return open_envelope(entry)[2]  # malformed: its BadEnvelope says how


# --- request headers -------------------------------------------------------------------------

# The headers, defined once with the client library's producer (node/client/producer.py).
__all__ = ["DUPLICATE_HEADER", "PRODUCER_HEADER", "SEQUENCE_HEADER"]


class InvalidProducerHeaders(ValueError):
    """``code`` is the stable error code of the answer (400)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_producer(
    producer: str | None, sequence: str | None, count: int
) -> tuple[str, int] | None:
    """The (producer, first sequence id) of an append of ``count`` entries with these header
    values; None without both; InvalidProducerHeaders when malformed or only one is given."""
    if producer is None and sequence is None:
        return None
    if producer is None or sequence is None:
        missing = PRODUCER_HEADER if producer is None else SEQUENCE_HEADER
        raise InvalidProducerHeaders(
            "invalid_producer_headers",
            f"{PRODUCER_HEADER} and {SEQUENCE_HEADER} go together: {missing} is missing",
        )
    if not NAME.fullmatch(producer):
        raise InvalidProducerHeaders(
            "invalid_producer_id",
            f"{PRODUCER_HEADER} is 1-255 of [A-Za-z0-9._-], not {producer[:60]!r}",
        )
    if not (sequence.isascii() and sequence.isdigit()) or len(sequence) > len(str(INT64_MAX)):
        raise InvalidProducerHeaders(
            "invalid_sequence_id",
            f"{SEQUENCE_HEADER} is a decimal integer in [0, 2^63 - 1], not {sequence[:30]!r}",
        )
    first = int(sequence)
    if first + count - 1 > INT64_MAX:
        raise InvalidProducerHeaders(
            "invalid_sequence_id",
            f"{SEQUENCE_HEADER} {first} and the {count} entries after it pass 2^63 - 1",
        )
    return producer, first


# --- the table -------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    """Sequence ids ``first``..``last`` of a producer, stored at consecutive entries of one
    ledger from ``at``: one append, or several that followed each other there."""

    first: int
    last: int
    at: Position

    def position(self, sequence: int) -> Position:
        return Position(self.at.ledger_id, self.at.entry_id + sequence - self.first)


@dataclass(slots=True)
class Producer:
    highest: int  # the highest sequence id persisted
    runs: list[Run]  # its last RECENT_RUNS runs, oldest first; the last one ends at highest
    seen_ms: int  # its last append, for the idle expiry


@dataclass(slots=True)
class Flight:
    """An append of a producer sent to the ledger and not settled: a retry of it waits."""

    first: int
    last: int
    done: asyncio.Future[tuple[int, list[int]]]  # its ledger and entry ids, once stored
    sent: asyncio.Future[list[int]] | None = None  # its last add sent to a ledger


@dataclass(slots=True)
class Check:
    """What to do with an append: ``positions`` (a duplicate stored there; empty: stored
    before the runs kept, where is not known), ``wait`` (it is in flight) or neither (new)."""

    positions: list[Position] | None = None
    wait: Flight | None = None


NEW = Check()  # a new append: shared, never changed


class SequenceOverlap(ValueError):
    """A batch whose ids are partly persisted and partly not: neither a retry nor new."""


@dataclass(slots=True)
class Table:
    """One stream's producers (see the module's docstring)."""

    producers: dict[str, Producer] = field(default_factory=dict)
    through: Position = BEFORE_ALL  # every entry up to here is in the table
    snapshot_ms: int = 0  # when the snapshot it was loaded from or last wrote was taken
    since_snapshot: int = 0  # entries recorded since
    flights: dict[str, list[Flight]] = field(default_factory=dict)

    def check(self, producer: str, first: int, count: int) -> Check:
        known = self.producers.get(producer)
        flights = self.flights.get(producer)
        if flights is None and (known is None or first > known.highest):
            return NEW  # the usual case: the producer's next id, nothing of it in flight
        last = first + count - 1
        for flight in flights or ():
            if first <= flight.last and last >= flight.first:
                if (first, last) != (flight.first, flight.last):
                    raise SequenceOverlap(
                        f"sequence ids {first}..{last} of producer {producer!r} overlap "
                        f"{flight.first}..{flight.last}, an append in flight"
                    )
                return Check(wait=flight)
        if known is None or first > known.highest:
            pushed = self.highest_pushed(producer)
            if first > pushed:
                return Check()
            if last > pushed:
                raise SequenceOverlap(
                    f"sequence ids {first}..{last} of producer {producer!r}: up to {pushed} "
                    "were sent already, the rest not; send those apart"
                )
            return Check(positions=[])  # below an id in flight: gone back, as Pulsar counts
        if last > known.highest:
            raise SequenceOverlap(
                f"sequence ids {first}..{last} of producer {producer!r}: up to "
                f"{known.highest} are in the stream, the rest not; send those apart"
            )
        for run in reversed(known.runs):  # most retries are of the last one
            if run.first <= first and last <= run.last:
                return Check(positions=[run.position(first + i) for i in range(count)])
        return Check(positions=[])  # older than the runs kept, or ids a gap skipped

    def last(self, producer: str) -> tuple[int, Position] | None:
        """Pulsar's getLastSequenceId: ``producer``'s highest persisted id and where it is
        stored (the end of its last run); None for a producer the table does not know."""
        known = self.producers.get(producer)
        if known is None:
            return None
        return known.highest, known.runs[-1].position(known.highest)

    def tracked(self) -> int:
        """Producers known or with an append in flight."""
        return len(self.producers) + sum(1 for name in self.flights if name not in self.producers)

    def highest_pushed(self, producer: str) -> int:
        """The highest id persisted or in flight (-1: none)."""
        known = self.producers.get(producer)
        top = -1 if known is None else known.highest
        for flight in self.flights.get(producer, ()):
            top = max(top, flight.last)
        return top

    def push(self, producer: str, first: int, count: int) -> Flight:
        flight = Flight(first, first + count - 1, asyncio.get_running_loop().create_future())
        flights = self.flights.get(producer)
        if flights is None:
            self.flights[producer] = [flight]
        else:
            flights.append(flight)
        return flight

    def land(self, producer: str, flight: Flight) -> None:
        flights = self.flights.get(producer)
        if flights is not None:
            flights.remove(flight)
            if not flights:
                del self.flights[producer]

    def record(self, producer: str | None, first: int, at: Position, count: int, now: int) -> None:
        """An append (or a replayed entry) stored at ``at``..; ``producer`` None: without
        producer headers (only ``through`` moves)."""
        ledger_id, last_entry = at.ledger_id, at.entry_id + count - 1
        through = self.through
        if ledger_id > through.ledger_id or (
            ledger_id == through.ledger_id and last_entry > through.entry_id
        ):
            self.through = Position(ledger_id, last_entry)
        self.since_snapshot += count
        if producer is None:
            return
        known = self.producers.get(producer)
        last = first + count - 1
        if known is None:
            self.producers[producer] = Producer(last, [Run(first, last, at)], now)
        elif last > known.highest:
            run = known.runs[-1]
            start = run.at
            if (
                first == run.last + 1
                and ledger_id == start.ledger_id
                and at.entry_id == start.entry_id + first - run.first
            ):
                run.last = last  # stored right after the run: it goes on
            else:
                known.runs.append(Run(first, last, at))
                if len(known.runs) > RECENT_RUNS:
                    del known.runs[0]
            known.highest, known.seen_ms = last, now
        else:
            known.seen_ms = now

    def expire(self, now_ms: int, idle_ms: int) -> int:
        """Forget producers silent for ``idle_ms`` with nothing in flight; how many."""
        idle = [
            name
            for name, p in self.producers.items()
            if now_ms - p.seen_ms >= idle_ms and name not in self.flights
        ]
        for name in idle:
            del self.producers[name]
        return len(idle)

    def encode(self, now_ms: int) -> bytes:
        """The snapshot record (JSON, versioned)."""
        return json.dumps(
            {
                "v": SNAPSHOT_VERSION,
                "through": str(self.through),
                "at": now_ms,
                "producers": {
                    name: [p.highest, p.seen_ms, [[r.first, r.last, *r.at] for r in p.runs]]
                    for name, p in self.producers.items()
                },
            }
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Table:
        raw = json.loads(data)
        version = raw.get("v")
        if version == 1:  # one run, from its first id to the highest
            producers = {
                name: Producer(highest, [Run(first, highest, Position.parse(at))], seen)
                for name, (highest, first, at, seen) in raw["producers"].items()
            }
        elif version == SNAPSHOT_VERSION:
            producers = {
                name: Producer(
                    highest, [Run(f, last, Position(lid, eid)) for f, last, lid, eid in runs], seen
                )
                for name, (highest, seen, runs) in raw["producers"].items()
            }
        else:
            raise ValueError(f"unsupported deduplication snapshot version {version}")
        return cls(producers, Position.parse(raw["through"]), raw["at"])


def snapshot_key(stream: str) -> bytes:
    return SNAPSHOT_PREFIX + stream.encode()
