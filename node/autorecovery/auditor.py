"""The auditor (BookKeeper's Auditor, one pass): which nodes are lost or being decommissioned,
which ledgers name them (with ``check_ledgers``, which replicas lack ids of a settled fragment,
from their indexes: ledgercheck.py; with ``check_replicas``, which replicas are missing an entry
or hold other bytes, every entry read: replicas.py), written as under-replicated markers for the
workers; then the report under ``autorecovery/auditor``. A node that only lacks entries is
marked "missing" (the worker copies them onto it), one that holds other bytes "replicas" (the
worker moves its fragments elsewhere).

A node is lost when it holds a cookie (``cookies/<id>``: it served once) but no registration
(``nodes/<id>``) and has been so for ``lost_node_delay_s``: the first audit that sees it gone,
or the first fleet poll of any node (fleet.py: every node's status page shows the same time),
writes ``lost/<id>`` with that time, and a later one that sees it registered again deletes it,
so a node restarted within the delay (a deploy, a reboot) costs no copying. The delay is counted
from that first sighting, within ``autorecovery_poll_s`` of the registration's end on a fleet of
running nodes, not from the crash.

A pass is idempotent: markers are created or CAS-merged (nodes added, never a reason replaced
but "missing" by a move: markers.merged),
and a marker's node is removed when it is back (registered and not decommissioning, for
"lost"), no longer decommissioning, or no longer in any segment of the ledger; a marker left
without nodes, or whose ledger is gone, is deleted."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from node.autorecovery import ledgercheck
from node.autorecovery import markers as m
from node.autorecovery.fleet import note_unregistered
from node.autorecovery.markers import AuditReport, Marker, Reason
from node.autorecovery.replicas import MISSING, Finding, check_ledger
from node.client.errors import CasConflict, NoSuchKey
from node.client.metadata.loop import update
from node.client.metadata.store import Versioned
from node.client.model import (
    LEDGERS_PREFIX,
    NODES_PREFIX,
    LedgerMetadata,
    MetadataFormatError,
    decode,
)

if TYPE_CHECKING:
    from node.client.client import Client


def _names(pairs: list[tuple[str, Versioned]], prefix: str) -> dict[str, Versioned]:
    return {key.removeprefix(prefix): versioned for key, versioned in pairs}


def _nodes_of(meta: LedgerMetadata) -> set[str]:
    return {n for segment in meta.segments for n in segment.ensemble}


def _fragments(meta: LedgerMetadata, nodes: set[str]) -> int:
    return sum(1 for s in meta.segments for n in s.ensemble if n in nodes)


async def _lost_nodes(client: Client, now_ms: int, delay_s: float) -> list[str]:
    """Record first sightings of known nodes gone, forget the ones back; those gone long enough."""
    since = await note_unregistered(client.store, now_ms)
    return [node for node, seen in since.items() if now_ms - seen >= delay_s * 1000]


async def _merge(client: Client, ledger_id: int, wanted: dict[str, Reason], now_ms: int) -> bool:
    """Create the marker or add the nodes it lacks; True when this call created it."""
    key = m.marker_key(ledger_id)
    while True:
        try:
            await client.store.create(key, Marker(ledger_id, wanted, now_ms).encode())
            return True
        except CasConflict as conflict:
            current = conflict.current

        def needs(raw: bytes) -> bool:
            nodes = Marker.decode(raw).nodes
            return m.merged(nodes, wanted) != nodes

        def transform(raw: bytes) -> bytes:
            old = Marker.decode(raw)
            return Marker(ledger_id, m.merged(old.nodes, wanted), old.created_ms).encode()

        try:
            await update(client.store, key, current, needs, transform)
            return False
        except NoSuchKey:
            continue  # a worker finished it meanwhile: create it again


async def _prune(
    client: Client,
    marker: Marker,
    versioned: Versioned,
    meta: LedgerMetadata | None,
    registered: set[str],
    decommissioning: set[str],
) -> Marker | None:
    """The marker without the nodes that need nothing any more (None: deleted, or gone)."""
    key = m.marker_key(marker.ledger_id)

    def keep(node: str, reason: Reason, current: LedgerMetadata | None) -> bool:
        if current is None or node not in _nodes_of(current):
            return False
        if reason is Reason.LOST:
            return node not in registered or node in decommissioning
        if reason is Reason.DECOMMISSIONING:
            return node in decommissioning
        return True  # "replicas", "missing": until a worker did it (or the node left)

    kept = {n: r for n, r in marker.nodes.items() if keep(n, r, meta)}
    if kept == marker.nodes:
        return marker
    if not kept:
        return None if await m.delete_if(client.store, key, versioned) else marker

    def needs(raw: bytes) -> bool:
        return any(n not in kept for n in Marker.decode(raw).nodes)

    def transform(raw: bytes) -> bytes:
        old = Marker.decode(raw)
        return Marker(
            old.ledger_id, {n: r for n, r in old.nodes.items() if n in kept}, old.created_ms
        ).encode()

    try:
        return Marker.decode((await update(client.store, key, versioned, needs, transform)).value)
    except NoSuchKey:
        return None


def _reasons(findings: list[Finding]) -> dict[str, Reason]:
    """The replicas check's findings on one ledger as reasons: a node that only lacks entries
    gets them copied ("missing"), one that holds other bytes is moved ("replicas")."""
    reasons: dict[str, Reason] = {}
    for finding in findings:
        if finding.kind != MISSING:
            reasons[finding.node] = Reason.REPLICAS
        else:
            reasons.setdefault(finding.node, Reason.MISSING)
    return reasons


async def _last_replicas_check_ms(client: Client) -> int:
    """When the previous reports say a replicas check last finished (0: never, or a report
    nobody can read, which the one this audit writes replaces)."""
    try:
        report = await m.read_report(client.store)
    except MetadataFormatError:
        return 0
    return report.last_replicas_check_ms if report else 0


async def audit(
    client: Client,
    *,
    lost_node_delay_s: float,
    check_ledgers: bool = False,
    check_replicas: bool = False,
    now_ms: int | None = None,
) -> AuditReport:
    """One pass of the auditor; its report is also written to ``autorecovery/auditor``.
    ``check_replicas`` reads every entry, which finds all that ``check_ledgers`` finds: with
    both, the ledger check is not run."""
    store = client.store
    now = int(time.time() * 1000) if now_ms is None else now_ms
    last_replicas_check_ms = await _last_replicas_check_ms(client)
    lost = await _lost_nodes(client, now, lost_node_delay_s)
    registered = set(_names(await store.range(NODES_PREFIX), NODES_PREFIX))
    decommissioning = set(
        _names(await store.range(m.DECOMMISSIONING_PREFIX), m.DECOMMISSIONING_PREFIX)
    )
    ledgers = {
        decode(v.value).ledger_id: decode(v.value) for _k, v in await store.range(LEDGERS_PREFIX)
    }

    created = removed = replicas_checked = missing = 0
    checked = ledgercheck.LedgerCheck()
    if check_ledgers and not check_replicas:
        checked = await ledgercheck.check_ledgers(
            client, ledgers.values(), skip=decommissioning | set(lost)
        )
        missing = checked.missing_entries
    wanted: dict[int, dict[str, Reason]] = {}
    for ledger_id, meta in ledgers.items():
        nodes = _nodes_of(meta)
        need = {n: Reason.DECOMMISSIONING for n in nodes & decommissioning}
        need |= {n: Reason.LOST for n in nodes & set(lost) if n not in need}
        if check_replicas:
            findings, read = await check_ledger(client, meta, skip=need.keys())
            replicas_checked += read
            missing += sum(1 for finding in findings if finding.kind == MISSING)
            need = {**_reasons(findings), **need}
        for node in checked.short.get(ledger_id, {}):
            need.setdefault(node, Reason.MISSING)
        if need:
            wanted[ledger_id] = need

    existing = {marker.ledger_id: (marker, v) for marker, v in await m.read_markers(store)}
    for ledger_id, (marker, versioned) in existing.items():
        pruned = await _prune(
            client, marker, versioned, ledgers.get(ledger_id), registered, decommissioning
        )
        if pruned is None:
            removed += 1
    for ledger_id, need in wanted.items():
        if await _merge(client, ledger_id, need, now):
            created += 1

    after = await m.read_markers(store)
    fragments = 0
    for marker, _v in after:
        marked = ledgers.get(marker.ledger_id)
        if marked is not None:
            fragments += _fragments(marked, set(marker.nodes))
    finished = int(time.time() * 1000) if now_ms is None else now_ms
    report = AuditReport(
        finished_ms=finished,
        under_replicated_ledgers=len(after),
        under_replicated_fragments=fragments,
        lost_nodes=sorted(lost),
        decommissioning_nodes=sorted(decommissioning),
        checked_ledgers=len(ledgers),
        replicas_checked=replicas_checked,
        markers_created=created,
        markers_removed=removed,
        markers=[marker.ledger_id for marker, _v in after],
        fragments_checked=checked.fragments,
        entries_missing=missing,
        last_replicas_check_ms=finished if check_replicas else last_replicas_check_ms,
    )
    await m.put(store, m.AUDITOR_KEY, report.encode())
    return report
