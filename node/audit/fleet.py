"""What the ``replicas`` check needs besides the snapshots: the replicated ledgers' metadata
as the metadata store held it, and which entries each node must therefore hold.

The metadata travels in a file, ``ledgers.json``, so that the Spark job needs no access to
the metadata store: a live node with a store writes one into each snapshot (read *before*
the snapshot: a ledger CLOSED in it was closed before the snapshot, so every one of its
entries was acknowledged before), and ``python -m node audit --ledgers FILE`` (or
``--metadata-url``, which dumps it first) gives one for snapshots that have none (a stopped
node's directory)::

    {"version": 1, "takenMs": ..., "ledgers": [<LedgerMetadata.to_json()>, ...],
     "unreadable": ["ledgers/<id>", ...]}

No pyspark here (the node writes the file); ``expected_ranges`` is plain Python over small
inputs (one row per segment and node), which the job then expands entry by entry in Spark.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from node.audit.kept import LEDGERS_FILE
from node.client.model import LEDGERS_PREFIX, LedgerMetadata, MetadataFormatError, decode

__all__ = ["LEDGERS_FILE", "FleetError", "dump", "expected_ranges", "parse", "read"]
FORMAT_VERSION = 1
NS_PER_MS = 1_000_000
NO_LAC = -1


class LedgerSource(Protocol):
    """The part of ``node.client.metadata.store.MetadataStore`` the dump uses."""

    async def range(self, prefix: str) -> list[tuple[str, Any]]: ...


class FleetError(Exception):
    """The ledgers file cannot be read (the audit exits 2)."""


async def dump(store: LedgerSource, now_ms: int | None = None) -> dict[str, Any]:
    """Every ledger's metadata in the store, as the ledgers file holds it. A value that
    does not decode is named, not dropped silently: the check cannot vouch for it."""
    taken = now_ms if now_ms is not None else time.time_ns() // NS_PER_MS
    ledgers: list[dict[str, Any]] = []
    unreadable: list[str] = []
    for key, versioned in await store.range(LEDGERS_PREFIX):
        try:
            ledgers.append(decode(versioned.value).to_json())
        except MetadataFormatError:
            unreadable.append(key)
    return {
        "version": FORMAT_VERSION,
        "takenMs": taken,
        "ledgers": ledgers,
        "unreadable": unreadable,
    }


def dump_url(metadata_url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """Blocking: ``dump`` of the etcd store at ``metadata_url`` (etcd://host:port/prefix)."""
    import asyncio

    from node.client.metadata.etcd import EtcdStore, parse_url

    parse_url(metadata_url)

    async def run() -> dict[str, Any]:
        store = EtcdStore(metadata_url, timeout_s=timeout_s)
        try:
            return await dump(store)
        finally:
            await store.close()

    return asyncio.run(run())


def encode(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def read(path: Path) -> list[LedgerMetadata]:
    """The ledgers of a ledgers file."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise FleetError(f"{path}: cannot read the ledgers file: {e}") from None
    return parse(doc, str(path))


def parse(doc: Any, where: str) -> list[LedgerMetadata]:
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        raise FleetError(f"{where}: not a ledgers file of version {FORMAT_VERSION}")
    try:
        return [decode(json.dumps({"formatVersion": 1, **raw}).encode()) for raw in doc["ledgers"]]
    except (MetadataFormatError, KeyError, TypeError) as e:
        raise FleetError(f"{where}: a ledger's metadata is not valid: {e}") from None


@dataclass(frozen=True, slots=True)
class Expected:
    """Node ``node`` (its snapshot's name) must hold the entries first..last of ``ledger_id``
    that fall in its write sets in this segment's ``ensemble``."""

    node: str
    node_id: str
    ledger_id: int
    first: int
    last: int
    ensemble: tuple[str, ...]
    ensemble_size: int
    write_quorum: int


@dataclass(slots=True)
class Plan:
    ranges: list[Expected] = field(default_factory=list)
    ledgers: int = 0  # replicated ledgers looked at (over every node's metadata)
    open_tail_skipped: int = 0  # OPEN last segments cut at the lowest writer LAC
    nodes_without_snapshot: set[str] = field(default_factory=set)  # named in a segment


def expected_ranges(
    metadata: Mapping[str, list[LedgerMetadata]],
    snapshots: Mapping[str, str],
    writer_lacs: Mapping[tuple[str, int], int],
) -> Plan:
    """What each node must hold.

    ``metadata``: per snapshot (its name), the ledgers as read before that snapshot was
    taken; ``snapshots``: snapshot name -> node id (only snapshots of a node with an id);
    ``writer_lacs``: (node id, ledger id) -> the writer's LAC that node recorded.

    A CLOSED ledger: entries 0..lastEntryId. An OPEN (or IN_RECOVERY) one: every segment but
    the last in full (an ensemble change starts the new segment after the LAC: every entry
    below was acknowledged), the last up to the lowest writer LAC its ensemble's nodes
    recorded (an entry at or below it was acknowledged before each of their snapshots);
    above that the tail may still be in flight: not checked."""
    plan = Plan()
    by_id = {node_id: name for name, node_id in snapshots.items()}
    for name, ledgers in metadata.items():
        node_id = snapshots.get(name)
        if node_id is None:
            continue
        plan.ledgers += len(ledgers)
        for meta in ledgers:
            for index, segment in enumerate(meta.segments):
                if node_id not in segment.ensemble:
                    continue
                last = _segment_last(meta, index, writer_lacs, by_id)
                if index == len(meta.segments) - 1 and not meta.closed:
                    plan.open_tail_skipped += 1
                if last < segment.first_entry_id:
                    continue
                plan.ranges.append(
                    Expected(
                        name,
                        node_id,
                        meta.ledger_id,
                        segment.first_entry_id,
                        last,
                        segment.ensemble,
                        meta.ensemble_size,
                        meta.write_quorum,
                    )
                )
    for ledgers in metadata.values():
        for meta in ledgers:
            for segment in meta.segments:
                plan.nodes_without_snapshot.update(n for n in segment.ensemble if n not in by_id)
    return plan


def _segment_last(
    meta: LedgerMetadata,
    index: int,
    writer_lacs: Mapping[tuple[str, int], int],
    fleet: Mapping[str, str],
) -> int:
    if index + 1 < len(meta.segments):
        return meta.segments[index + 1].first_entry_id - 1
    if meta.closed:
        return meta.last_entry_id
    # Only nodes of the fleet say anything; one that holds nothing of the ledger says -1.
    ensemble = [node for node in meta.segments[index].ensemble if node in fleet]
    return min(
        (writer_lacs.get((node, meta.ledger_id), NO_LAC) for node in ensemble), default=NO_LAC
    )
