"""What a stream is made of, and how it is stored in the storage's streams keyspace.

Records (JSON values, each with a format version ``v``)::

    key  b"stream/" + name              value {"v": 1, "name", "created", "policies", "ledgers",
                                                   "replication" (replicated streams only)}
    key  b"cursor/" + name + 0x00 + cur value {"v": 1, "markDelete": [ledger, entry], "created"}
    key  b"doomed/" + ledger id (decimal) value {"v": 1, "stream", "offload" (optional)}
    key  b"dedup/" + name               value a deduplicating stream's producer table snapshot
                                              (node.streams.dedup)

A ``doomed`` record names a ledger that a trim or a stream deletion dropped from its stream
and has yet to delete (with ``"offload"``, the attempt whose objects go with it; the
replicated ledger under an offloaded ledger of a replicated stream gets one, without
``"offload"``, when its replicas go after the deletion lag): written in the same batch as
the stream record that drops it, removed once the ledger is deleted, so that start() tells a
ledger it must finish deleting from one that no stream names for another reason (which it
keeps: it may hold acknowledged data).

``ledgers`` lists the stream's ledgers oldest first, each ``{"id", "entries", "bytes",
"created", "closed"}``; the last one takes appends (``closed`` 0), the others are closed
(``"closing": true`` while a rollover's close of it is not confirmed: its counts may be short
until then; ``"envelope": true`` when its entries carry a producer header, node.streams.dedup). A
replicated stream's ledger also carries its offload record once an offload began (a node's own
ledger keeps it in the ledger's metadata instead): ``"offload": {"state": "in_progress" |
"offloaded", "attempt", "bytes", "at", "replicasDeleted"}`` (Pulsar's OffloadContext:
``replicasDeleted`` is its bookkeeperDeleted; from then on the ledger is read from the
object store).
Positions are (ledger id, entry id), written ``L:E``. A cursor's mark-delete position is the
last entry it acknowledged: everything at or before it is consumed; (L, -1) means nothing of
ledger L yet. A cursor made on a stream with no ledger yet is stored at (0, -1), before every
ledger; the API shows it as null until the stream has a ledger (``Stream.shown_mark``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from node.streams.policies import INT64_MAX, Policies

if TYPE_CHECKING:  # Spark workers import this module without the engine (and its RocksDB)
    from node.storage.index import LedgerMeta, OffloadInfo

FORMAT_VERSION = 1
STREAM_PREFIX = b"stream/"
CURSOR_PREFIX = b"cursor/"
DOOMED_PREFIX = b"doomed/"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
# ASCII digits only (str.isdigit also takes other scripts' digits, which int() reads), at
# most 19 of them (2^63 has 19), in canonical form: "00:1" is not another name of "0:1".
ID_DIGITS = "(0|[1-9][0-9]{0,18})"
POSITION = re.compile(rf"{ID_DIGITS}:(-1|{ID_DIGITS})")
MINUTE_MS = 60_000


class Replication(NamedTuple):
    """E/Qw/Qa of a replicated stream's ledgers (BookKeeper's ensemble, write and ack quorum).
    A stream of a node without a metadata store has none: its ledgers are the node's own."""

    ensemble: int
    write_quorum: int
    ack_quorum: int

    def to_json(self) -> dict[str, int]:
        return {
            "ensemble": self.ensemble,
            "writeQuorum": self.write_quorum,
            "ackQuorum": self.ack_quorum,
        }

    @classmethod
    def from_json(cls, data: dict[str, int]) -> Replication:
        return cls(data["ensemble"], data["writeQuorum"], data["ackQuorum"])


class PositionOutOfRange(ValueError):
    """Well formed, but past 2^63 - 1: no stream holds such a position."""


class Position(NamedTuple):
    ledger_id: int
    entry_id: int

    def __str__(self) -> str:
        return f"{self.ledger_id}:{self.entry_id}"

    @classmethod
    def parse(cls, text: str) -> Position:
        """``L:E`` with E >= -1; ValueError otherwise."""
        match = POSITION.fullmatch(text)
        if match is None:
            raise ValueError(f"a position is written L:E (ledger id:entry id), not {text[:40]!r}")
        position = cls(int(match[1]), int(match[2]))
        if position.ledger_id > INT64_MAX or position.entry_id > INT64_MAX:
            raise PositionOutOfRange(f"position {text[:40]!r} is out of range")
        return position


OFFLOAD_STATES = {1: "in_progress", 2: "offloaded"}  # node.storage.index.OffloadState's values


@dataclass(slots=True)
class LedgerInfo:
    ledger_id: int
    entries: int = 0
    size_bytes: int = 0
    created_ms: int = 0
    closed_ms: int = 0  # 0 while it takes appends
    offload: OffloadInfo | None = None  # replicated streams only (see the module's docstring)
    # Rolled over from, its close not confirmed yet: ``entries`` may lag what was acknowledged
    # in it until the close (or a takeover's recovery) settles its end.
    closing: bool = False
    # Its entries carry a producer header (node.streams.dedup): created while the stream's
    # deduplication policy was on.
    envelope: bool = False

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "id": self.ledger_id,
            "entries": self.entries,
            "bytes": self.size_bytes,
            "created": self.created_ms,
            "closed": self.closed_ms,
        }
        if self.closing:
            data["closing"] = True
        if self.envelope:
            data["envelope"] = True
        if self.offload is not None:
            data["offload"] = {
                "state": OFFLOAD_STATES[self.offload.state],
                "attempt": self.offload.attempt,
                "bytes": self.offload.data_bytes,
                "at": self.offload.offloaded_ms,
                "replicasDeleted": self.offload.local_deleted,
            }
        return data

    def meta(self, stream: str) -> LedgerMeta:
        """The ledger as the stream record has it, in the storage's terms (what offload
        and its cold reads take)."""
        from node.storage.index import STREAM_PROPERTY, LedgerMeta, LedgerState

        return LedgerMeta(
            self.ledger_id,
            LedgerState.CLOSED if self.closed_ms and not self.closing else LedgerState.OPEN,
            lac=self.entries - 1,
            last_entry_id=self.entries - 1,
            entries=self.entries,
            payload_bytes=self.size_bytes,
            created_ms=self.created_ms,
            closed_ms=self.closed_ms,
            properties={STREAM_PROPERTY: stream},
            offload=self.offload,
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LedgerInfo:
        from node.storage.index import OffloadInfo, OffloadState

        offload = data.get("offload")
        return cls(
            data["id"],
            data["entries"],
            data["bytes"],
            data["created"],
            data["closed"],
            None
            if offload is None
            else OffloadInfo(
                OffloadState(next(k for k, v in OFFLOAD_STATES.items() if v == offload["state"])),
                offload["attempt"],
                offload["bytes"],
                offload["at"],
                offload["replicasDeleted"],
            ),
            bool(data.get("closing", False)),
            bool(data.get("envelope", False)),
        )


@dataclass(slots=True)
class Stream:
    name: str
    policies: Policies
    created_ms: int
    ledgers: list[LedgerInfo] = field(default_factory=list)
    replication: Replication | None = None

    def key(self) -> bytes:
        return STREAM_PREFIX + self.name.encode()

    def shown_mark(self, mark: Position) -> Position | None:
        """A cursor's mark-delete as the API shows it. None while the stream holds no ledger
        (nothing to acknowledge yet). A mark before the stream's first ledger (a cursor made
        on an empty stream is kept at 0:-1, which sorts before every ledger; one whose
        ledgers retention deleted keeps their id) is the same as acknowledging nothing of
        that ledger: shown as its L:-1, never naming a ledger the stream does not hold."""
        if not self.ledgers:
            return None
        return max(mark, Position(self.ledgers[0].ledger_id, -1))

    def encode(self) -> bytes:
        record: dict[str, object] = {
            "v": FORMAT_VERSION,
            "name": self.name,
            "created": self.created_ms,
            "policies": self.policies.to_json(),
            "ledgers": [info.to_json() for info in self.ledgers],
        }
        if self.replication is not None:
            record["replication"] = self.replication.to_json()
        return json.dumps(record).encode()

    @classmethod
    def decode(cls, data: bytes) -> Stream:
        raw = json.loads(data)
        if raw.get("v") != FORMAT_VERSION:
            raise ValueError(f"unsupported stream record version {raw.get('v')}")
        return cls(
            raw["name"],
            Policies(**raw["policies"]),
            raw["created"],
            [LedgerInfo.from_json(info) for info in raw["ledgers"]],
            Replication.from_json(raw["replication"]) if "replication" in raw else None,
        )


@dataclass(slots=True)
class Cursor:
    stream: str
    name: str
    mark_delete: Position
    created_ms: int

    def key(self) -> bytes:
        return cursor_key(self.stream, self.name)

    def encode(self) -> bytes:
        return json.dumps(
            {"v": FORMAT_VERSION, "markDelete": list(self.mark_delete), "created": self.created_ms}
        ).encode()

    @classmethod
    def decode(cls, key: bytes, data: bytes) -> Cursor:
        stream, _, name = key.removeprefix(CURSOR_PREFIX).partition(b"\0")
        raw = json.loads(data)
        if raw.get("v") != FORMAT_VERSION:
            raise ValueError(f"unsupported cursor record version {raw.get('v')}")
        return cls(stream.decode(), name.decode(), Position(*raw["markDelete"]), raw["created"])


def cursor_key(stream: str, name: str) -> bytes:
    return CURSOR_PREFIX + stream.encode() + b"\0" + name.encode()


def doomed_key(ledger_id: int) -> bytes:
    return DOOMED_PREFIX + str(ledger_id).encode()


def encode_doomed(stream: str, offload: str | None = None) -> bytes:
    """``offload``: the attempt whose objects are deleted with the ledger."""
    record: dict[str, object] = {"v": FORMAT_VERSION, "stream": stream}
    if offload is not None:
        record["offload"] = offload
    return json.dumps(record).encode()


def doomed_objects(value: bytes) -> str | None:
    """The offload attempt a doomed record deletes the objects of (None: none)."""
    offload = json.loads(value).get("offload")
    return offload if isinstance(offload, str) else None


def decode_doomed_key(key: bytes) -> int:
    return int(key.removeprefix(DOOMED_PREFIX))
