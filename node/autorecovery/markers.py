"""What autorecovery keeps in the metadata store, beside ``ledgers/``, ``nodes/`` and
``cookies/`` under the cluster's prefix. Every value is compact JSON with ``"version": 1``; a
reader refuses another version (MetadataFormatError), it never guesses.

==================================  ==========================================  ============
key                                 value                                       written by
==================================  ==========================================  ============
underreplicated/<19-digit ledger>   {"ledgerId", "nodes": {"<node>": "lost" |   auditor
                                    "decommissioning" | "replicas" |            (create, CAS
                                    "missing"}, "createdMs"}                    merge);
                                                                                worker
                                                                                (removes)
underreplicated-locks/<ledger>      {"worker", "sinceMs"}, under a lease of     worker
                                    ``lock_ttl_s`` kept alive while it copies
lost/<node>                         {"sinceMs"}: the first audit or node's      auditor,
                                    fleet poll that saw a node with a cookie    every node's
                                    unregistered; deleted once it is            fleet poll
                                    registered again                            (fleet.py)
decommissioning/<node>              {"sinceMs"}                                 decommission
autorecovery/auditor                the last AuditReport (``finishedMs``,       auditor
                                    counts, lost and decommissioning nodes,
                                    when the last replicas check ran)
autorecovery/totals                 {"fragments", "entries", "bytes"}           worker
                                    re-replicated since the cluster began,
                                    added after each fragment's CAS
==================================  ==========================================  ============

A marker names the nodes of a ledger whose copies must move elsewhere: "lost" (its registration
has been gone longer than the lost-node delay), "decommissioning" (an operator asked), "replicas"
(the replicas check found an entry missing there, or other bytes than the other replicas hold);
or, "missing", a node that stays but lacks ids of a settled fragment (the ledger check, from its
index): the worker copies those entries onto it. A move supersedes a fill: an audit that finds a
"missing" node lost or decommissioning changes its reason.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from node.client.errors import CasConflict, NoSuchKey, OutcomeUnknown, StoreUnavailable
from node.client.metadata.loop import DEFAULT_ATTEMPTS, DEFAULT_PAUSE_S, read_with_retry, update
from node.client.metadata.store import MetadataStore, Versioned
from node.client.model import DECOMMISSIONING_PREFIX as DECOMMISSIONING_PREFIX
from node.client.model import MetadataFormatError

VERSION = 1
MARKERS_PREFIX = "underreplicated/"
LOCKS_PREFIX = "underreplicated-locks/"
LOST_PREFIX = "lost/"
AUDITOR_KEY = "autorecovery/auditor"
TOTALS_KEY = "autorecovery/totals"


class Reason(StrEnum):
    LOST = "lost"
    DECOMMISSIONING = "decommissioning"
    REPLICAS = "replicas"
    MISSING = "missing"  # the node keeps its place; the entries it lacks are copied onto it


def merged(old: dict[str, Reason], wanted: dict[str, Reason]) -> dict[str, Reason]:
    """A marker's nodes with ``wanted`` added: a node's reason stays, but that a move
    (lost, decommissioning, replicas) replaces a fill (missing)."""
    nodes = {**wanted, **old}
    for node, reason in wanted.items():
        if old.get(node) is Reason.MISSING:
            nodes[node] = reason
    return nodes


def marker_key(ledger_id: int) -> str:
    """Zero-padded like ``ledgers/``: a range lists markers in ledger id order."""
    return f"{MARKERS_PREFIX}{ledger_id:019d}"


def lock_key(ledger_id: int) -> str:
    return f"{LOCKS_PREFIX}{ledger_id:019d}"


def lost_key(node_id: str) -> str:
    return f"{LOST_PREFIX}{node_id}"


def decommissioning_key(node_id: str) -> str:
    return f"{DECOMMISSIONING_PREFIX}{node_id}"


def ledger_id_of_marker(key: str) -> int:
    return int(key.removeprefix(MARKERS_PREFIX))


def _encode(value: dict[str, Any]) -> bytes:
    return json.dumps({"version": VERSION, **value}, separators=(",", ":"), sort_keys=True).encode()


def _decode(data: bytes, what: str) -> dict[str, Any]:
    try:
        raw = json.loads(data)
    except ValueError as error:
        raise MetadataFormatError(f"not {what}: {error}") from error
    if not isinstance(raw, dict) or raw.get("version") != VERSION:
        version = raw.get("version") if isinstance(raw, dict) else None
        raise MetadataFormatError(f"{what}: unknown version {version!r}")
    return raw


@dataclass(frozen=True)
class Marker:
    ledger_id: int
    nodes: dict[str, Reason]
    created_ms: int

    def encode(self) -> bytes:
        nodes = {n: r.value for n, r in sorted(self.nodes.items())}
        return _encode({"ledgerId": self.ledger_id, "nodes": nodes, "createdMs": self.created_ms})

    @staticmethod
    def decode(data: bytes) -> Marker:
        raw = _decode(data, "an under-replicated marker")
        try:
            return Marker(
                ledger_id=int(raw["ledgerId"]),
                nodes={str(n): Reason(r) for n, r in raw["nodes"].items()},
                created_ms=int(raw["createdMs"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise MetadataFormatError(f"not an under-replicated marker: {error}") from error


@dataclass(frozen=True)
class Lock:
    worker: str
    since_ms: int

    def encode(self) -> bytes:
        return _encode({"worker": self.worker, "sinceMs": self.since_ms})

    @staticmethod
    def decode(data: bytes) -> Lock:
        raw = _decode(data, "a marker's lock")
        try:
            return Lock(worker=str(raw["worker"]), since_ms=int(raw["sinceMs"]))
        except (ValueError, KeyError, TypeError) as error:
            raise MetadataFormatError(f"not a marker's lock: {error}") from error


def encode_since(since_ms: int) -> bytes:
    """The value of ``lost/<node>`` and ``decommissioning/<node>``."""
    return _encode({"sinceMs": since_ms})


def decode_since(data: bytes) -> int:
    raw = _decode(data, "a lost or decommissioning mark")
    try:
        return int(raw["sinceMs"])
    except (ValueError, KeyError, TypeError) as error:
        raise MetadataFormatError(f"not a lost or decommissioning mark: {error}") from error


@dataclass(frozen=True)
class Totals:
    fragments: int = 0
    entries: int = 0
    size: int = 0  # payload bytes ("bytes" in the JSON)

    def encode(self) -> bytes:
        return _encode(self.to_json())

    @staticmethod
    def decode(data: bytes) -> Totals:
        raw = _decode(data, "autorecovery totals")
        try:
            return Totals(int(raw["fragments"]), int(raw["entries"]), int(raw["bytes"]))
        except (ValueError, KeyError, TypeError) as error:
            raise MetadataFormatError(f"not autorecovery totals: {error}") from error

    def to_json(self) -> dict[str, int]:
        return {"fragments": self.fragments, "entries": self.entries, "bytes": self.size}


@dataclass(frozen=True)
class AuditReport:
    """One audit's view, as ``autorecovery/auditor`` holds it (metrics and the status route read
    it); ``markers`` (the ledger ids marked after the audit) is the route's, not stored."""

    finished_ms: int
    under_replicated_ledgers: int
    under_replicated_fragments: int
    lost_nodes: list[str]
    decommissioning_nodes: list[str]
    checked_ledgers: int
    replicas_checked: int
    markers_created: int
    markers_removed: int
    markers: list[int] = field(default_factory=list)
    fragments_checked: int = 0  # fragments the ledger check asked about (and got answers)
    entries_missing: int = 0  # ids of settled fragments their replicas lack
    last_replicas_check_ms: int = 0  # when a replicas check last finished; 0: never

    def to_json(self) -> dict[str, Any]:
        return {
            "finishedMs": self.finished_ms,
            "underReplicatedLedgers": self.under_replicated_ledgers,
            "underReplicatedFragments": self.under_replicated_fragments,
            "lostNodes": self.lost_nodes,
            "decommissioningNodes": self.decommissioning_nodes,
            "checkedLedgers": self.checked_ledgers,
            "replicasChecked": self.replicas_checked,
            "markersCreated": self.markers_created,
            "markersRemoved": self.markers_removed,
            "fragmentsChecked": self.fragments_checked,
            "entriesMissing": self.entries_missing,
            "lastReplicasCheckMs": self.last_replicas_check_ms,
        }

    def encode(self) -> bytes:
        return _encode(self.to_json())

    @staticmethod
    def decode(data: bytes) -> AuditReport:
        raw = _decode(data, "an audit report")
        try:
            return AuditReport(
                finished_ms=int(raw["finishedMs"]),
                under_replicated_ledgers=int(raw["underReplicatedLedgers"]),
                under_replicated_fragments=int(raw["underReplicatedFragments"]),
                lost_nodes=[str(n) for n in raw["lostNodes"]],
                decommissioning_nodes=[str(n) for n in raw["decommissioningNodes"]],
                checked_ledgers=int(raw["checkedLedgers"]),
                replicas_checked=int(raw["replicasChecked"]),
                markers_created=int(raw["markersCreated"]),
                markers_removed=int(raw["markersRemoved"]),
                # Absent from the reports of nodes from before the ledger check.
                fragments_checked=int(raw.get("fragmentsChecked", 0)),
                entries_missing=int(raw.get("entriesMissing", 0)),
                last_replicas_check_ms=int(raw.get("lastReplicasCheckMs", 0)),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise MetadataFormatError(f"not an audit report: {error}") from error


async def put(store: MetadataStore, key: str, value: bytes) -> Versioned:
    """Create ``key`` or replace whatever it holds with ``value`` (the store has no
    unconditional put outside a lease: a create, else the CAS loop)."""
    while True:
        try:
            return await store.create(key, value)
        except CasConflict as conflict:
            try:
                return await update(
                    store, key, conflict.current, lambda raw: raw != value, lambda _: value
                )
            except NoSuchKey:
                continue  # deleted between the two: create again


async def delete_if(store: MetadataStore, key: str, current: Versioned) -> bool:
    """Delete ``key`` at ``current``'s revision; False when it changed or is gone meanwhile."""
    try:
        await store.delete(key, current.revision)
    except (CasConflict, NoSuchKey):
        return False
    return True


async def read_markers(store: MetadataStore) -> list[tuple[Marker, Versioned]]:
    """Every marker, in ledger id order."""
    return [(Marker.decode(v.value), v) for _key, v in await store.range(MARKERS_PREFIX)]


async def read_totals(store: MetadataStore) -> Totals:
    found = await store.get(TOTALS_KEY)
    return Totals.decode(found.value) if found else Totals()


async def read_report(store: MetadataStore) -> AuditReport | None:
    found = await store.get(AUDITOR_KEY)
    return AuditReport.decode(found.value) if found else None


async def swap_counted(
    store: MetadataStore,
    key: str,
    needs_update: Callable[[bytes], bool],
    transform: Callable[[bytes], bytes | None],
    counted: Totals,
    *,
    attempts: int = DEFAULT_ATTEMPTS,
    pause_s: float = DEFAULT_PAUSE_S,
) -> bytes | None:
    """The update loop (node.client.metadata.loop.update) of ``key``, with ``counted`` added
    to ``autorecovery/totals`` in the same commit: a worker that dies right after its CAS
    cannot leave a fragment replaced but not counted, and one that finds the change made
    (by another worker, or its own commit whose answer was lost) counts nothing. A transform
    that returns None deletes the key. Returns the key's value that satisfies the caller
    (None: deleted). NoSuchKey when the key is gone."""
    failures = 0
    while True:
        try:
            current = await read_with_retry(store, key, attempts=attempts, pause_s=pause_s)
            if current is None:
                raise NoSuchKey(key)
            if not needs_update(current.value):
                return current.value
            found = await read_with_retry(store, TOTALS_KEY, attempts=attempts, pause_s=pause_s)
            old = Totals.decode(found.value) if found is not None else Totals()
            new = Totals(
                old.fragments + counted.fragments,
                old.entries + counted.entries,
                old.size + counted.size,
            )
            changed = transform(current.value)
            await store.commit(
                {key: current.revision, TOTALS_KEY: found.revision if found is not None else 0},
                {key: changed, TOTALS_KEY: new.encode()},
            )
            return changed
        except CasConflict:
            continue  # another writer of either key went first: read both again
        except (StoreUnavailable, OutcomeUnknown):
            failures += 1
            if failures >= attempts:
                raise
            await asyncio.sleep(pause_s)
