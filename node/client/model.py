"""A replicated ledger's metadata, as the metadata store holds it under ``ledgers/<id>``:
BookKeeper's fields (``LedgerMetadataFormat``), as compact JSON, checked on every encode and
decode. A value that breaks an invariant is an error, never repaired.

=================  =========================================================================
field              meaning
=================  =========================================================================
formatVersion      1; a reader refuses another
ledgerId           fleet-wide id (>= 2**62, from the store's allocator)
ensembleSize       E: nodes in each segment's ensemble
writeQuorumSize    Qw: copies of each entry (entry e goes to Qw consecutive nodes from e mod E)
ackQuorumSize      Qa: durable copies before an add is acknowledged
state              OPEN -> IN_RECOVERY -> CLOSED (OPEN -> CLOSED for a writer's close)
lastEntryId        -1 until closed; the last entry of a CLOSED ledger (-1: empty)
length             bytes of payload up to lastEntryId (0 until closed)
segments           [{firstEntryId, ensemble: [node ids]}], firstEntryId strictly increasing
ctime              creation time, ms since the epoch
closedTime         ms since the epoch when closed, else null
creator            who created it (host/pid and a nonce: a lost create reply is resolved by it)
properties         the caller's string properties
=================  =========================================================================
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

FORMAT_VERSION = 1
LEDGERS_PREFIX = "ledgers/"
NODES_PREFIX = "nodes/"
COOKIES_PREFIX = "cookies/"
# Nodes an operator is taking out (node/autorecovery/decommission.py): placement skips them.
DECOMMISSIONING_PREFIX = "decommissioning/"
CLUSTER_KEY = "cluster"


def ledger_key(ledger_id: int) -> str:
    """Zero-padded to 19 digits, so a range over ``ledgers/`` lists ledgers in id order."""
    return f"{LEDGERS_PREFIX}{ledger_id:019d}"


def ledger_id_of(key: str) -> int:
    return int(key.removeprefix(LEDGERS_PREFIX))


def node_key(node_id: str) -> str:
    return f"{NODES_PREFIX}{node_id}"


def cookie_key(node_id: str) -> str:
    return f"{COOKIES_PREFIX}{node_id}"


class MetadataFormatError(ValueError):
    """A ledger metadata value that is not well formed or breaks an invariant."""


class LedgerState(StrEnum):
    OPEN = "OPEN"
    IN_RECOVERY = "IN_RECOVERY"
    CLOSED = "CLOSED"


@dataclass(frozen=True)
class Segment:
    first_entry_id: int
    ensemble: tuple[str, ...]


@dataclass(frozen=True)
class LedgerMetadata:
    ledger_id: int
    ensemble_size: int
    write_quorum: int
    ack_quorum: int
    segments: tuple[Segment, ...]
    state: LedgerState = LedgerState.OPEN
    last_entry_id: int = -1
    length: int = 0
    ctime_ms: int = 0
    closed_ms: int | None = None
    creator: str = ""
    properties: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check(self)

    def segment_of(self, entry_id: int) -> Segment:
        """The segment whose ensemble holds ``entry_id``."""
        for segment in reversed(self.segments):
            if segment.first_entry_id <= entry_id:
                return segment
        return self.segments[0]

    def write_set(self, entry_id: int) -> list[str]:
        """The Qw nodes that hold ``entry_id``: consecutive in its segment's ensemble from
        entry_id mod E."""
        ensemble = self.segment_of(entry_id).ensemble
        return [ensemble[(entry_id + i) % self.ensemble_size] for i in range(self.write_quorum)]

    @property
    def last_segment(self) -> Segment:
        return self.segments[-1]

    @property
    def closed(self) -> bool:
        return self.state is LedgerState.CLOSED

    def evolve(self, **changes: Any) -> LedgerMetadata:
        """A copy with ``changes``, checked like any other value."""
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """BookKeeper's field names, as ``client.ledger_metadata`` returns them."""
        return {
            "ledgerId": self.ledger_id,
            "ensembleSize": self.ensemble_size,
            "writeQuorumSize": self.write_quorum,
            "ackQuorumSize": self.ack_quorum,
            "state": self.state.value,
            "lastEntryId": self.last_entry_id,
            "length": self.length,
            "segments": [
                {"firstEntryId": s.first_entry_id, "ensemble": list(s.ensemble)}
                for s in self.segments
            ],
            "ctime": self.ctime_ms,
            "closedTime": self.closed_ms,
            "creator": self.creator,
            "properties": dict(self.properties),
        }


def check(meta: LedgerMetadata) -> None:
    """Raise MetadataFormatError unless ``meta`` keeps every invariant of a ledger."""
    e, qw, qa = meta.ensemble_size, meta.write_quorum, meta.ack_quorum
    if not e >= qw >= qa >= 1:
        raise MetadataFormatError(
            f"ledger {meta.ledger_id}: needs E >= Qw >= Qa >= 1 ({e}/{qw}/{qa})"
        )
    if not meta.segments:
        raise MetadataFormatError(f"ledger {meta.ledger_id}: no segment")
    previous = -1
    for index, segment in enumerate(meta.segments):
        if len(segment.ensemble) != e or len(set(segment.ensemble)) != e:
            raise MetadataFormatError(
                f"ledger {meta.ledger_id}: segment {index} needs {e} distinct nodes, "
                f"has {list(segment.ensemble)}"
            )
        if segment.first_entry_id < 0 or (index and segment.first_entry_id <= previous):
            raise MetadataFormatError(
                f"ledger {meta.ledger_id}: segment {index} starts at {segment.first_entry_id}, "
                f"not after {previous}"
            )
        previous = segment.first_entry_id
    if meta.segments[0].first_entry_id != 0:
        raise MetadataFormatError(f"ledger {meta.ledger_id}: the first segment must start at 0")
    if meta.last_entry_id < -1 or meta.length < 0:
        raise MetadataFormatError(f"ledger {meta.ledger_id}: negative lastEntryId or length")
    if meta.state is not LedgerState.CLOSED and (meta.last_entry_id != -1 or meta.length):
        raise MetadataFormatError(
            f"ledger {meta.ledger_id}: lastEntryId and length are set only when CLOSED"
        )
    if meta.closed and meta.last_entry_id < meta.last_segment.first_entry_id - 1:
        raise MetadataFormatError(
            f"ledger {meta.ledger_id}: closed at {meta.last_entry_id}, before its last segment "
            f"({meta.last_segment.first_entry_id})"
        )


def encode(meta: LedgerMetadata) -> bytes:
    check(meta)
    value = {"formatVersion": FORMAT_VERSION, **meta.to_json()}
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def decode(data: bytes) -> LedgerMetadata:
    try:
        raw = json.loads(data)
        if raw.get("formatVersion") != FORMAT_VERSION:
            raise MetadataFormatError(f"unknown formatVersion {raw.get('formatVersion')!r}")
        return LedgerMetadata(
            ledger_id=int(raw["ledgerId"]),
            ensemble_size=int(raw["ensembleSize"]),
            write_quorum=int(raw["writeQuorumSize"]),
            ack_quorum=int(raw["ackQuorumSize"]),
            state=LedgerState(raw["state"]),
            last_entry_id=int(raw["lastEntryId"]),
            length=int(raw["length"]),
            segments=tuple(
                Segment(int(s["firstEntryId"]), tuple(str(n) for n in s["ensemble"]))
                for s in raw["segments"]
            ),
            ctime_ms=int(raw["ctime"]),
            closed_ms=None if raw.get("closedTime") is None else int(raw["closedTime"]),
            creator=str(raw.get("creator", "")),
            properties={str(k): str(v) for k, v in (raw.get("properties") or {}).items()},
        )
    except MetadataFormatError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise MetadataFormatError(f"not a ledger metadata value: {error}") from error


class NodeState(StrEnum):
    WRITABLE = "writable"
    READONLY = "readonly"


@dataclass(frozen=True)
class NodeInfo:
    """A node's registration, ``nodes/<id>`` under the node's lease: gone when the node is.

    ``{"id", "url", "zone", "state": "writable"|"readonly", "instanceId", "startedMs"}``
    """

    node_id: str
    url: str
    zone: str = ""
    state: NodeState = NodeState.WRITABLE
    instance_id: str = ""
    started_ms: int = 0

    def encode(self) -> bytes:
        value = {
            "id": self.node_id,
            "url": self.url,
            "zone": self.zone,
            "state": self.state.value,
            "instanceId": self.instance_id,
            "startedMs": self.started_ms,
        }
        return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()

    @staticmethod
    def decode(data: bytes) -> NodeInfo:
        try:
            raw = json.loads(data)
            return NodeInfo(
                node_id=str(raw["id"]),
                url=str(raw["url"]),
                zone=str(raw.get("zone", "")),
                state=NodeState(raw.get("state", "writable")),
                instance_id=str(raw.get("instanceId", "")),
                started_ms=int(raw.get("startedMs", 0)),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise MetadataFormatError(f"not a node registration: {error}") from error
