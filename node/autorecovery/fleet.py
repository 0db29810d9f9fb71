"""The fleet as the metadata store says, for every node's status page: every node the store
knows (registered under ``nodes/``, holding a cookie under ``cookies/``, or named by a ledger's
ensemble), its state, the open ledgers whose last ensemble names it (with how many of that
ensemble's nodes are registered, against the ack quorum) and when the auditor counts it lost.

The first sighting of a node unregistered is the auditor's ``lost/<id>`` mark
(``note_unregistered``), which the auditor and every node's fleet poll both write, first writer
wins: the time is the store's, the same on every node, and the lost-node delay counts from when
the fleet first saw the node gone rather than from whenever an audit next ran.

A ledger is at risk the moment a segment of it names a node that is not registered: no audit
needs to run first (an audit then marks it under-replicated once the node is lost)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from node.autorecovery import markers as m
from node.client.errors import CasConflict
from node.client.metadata.store import MetadataStore, Versioned
from node.client.model import (
    COOKIES_PREFIX,
    DECOMMISSIONING_PREFIX,
    LEDGERS_PREFIX,
    NODES_PREFIX,
    LedgerMetadata,
    MetadataFormatError,
    NodeInfo,
    NodeState,
    decode,
)

MS_PER_S = 1000
# The ledger property naming a stream's ledger (node.storage.index.STREAM_PROPERTY: the
# engine's, which autorecovery must not import; tests/autorecovery checks they agree).
STREAM_PROPERTY = "stream"


def _names(pairs: list[tuple[str, Versioned]], prefix: str) -> dict[str, Versioned]:
    return {key.removeprefix(prefix): versioned for key, versioned in pairs}


async def note_unregistered(store: MetadataStore, now_ms: int) -> dict[str, int]:
    """Record the first sighting (``lost/<id>``) of each node with a cookie and no
    registration, forget the nodes back; {node: since when it is seen unregistered}."""
    registered = _names(await store.range(NODES_PREFIX), NODES_PREFIX)
    cookies = _names(await store.range(COOKIES_PREFIX), COOKIES_PREFIX)
    return await _note(store, now_ms, set(registered), set(cookies))


async def _note(
    store: MetadataStore, now_ms: int, registered: set[str], cookies: set[str]
) -> dict[str, int]:
    marks = _names(await store.range(m.LOST_PREFIX), m.LOST_PREFIX)
    for node, seen in marks.items():
        if node in registered or node not in cookies:
            await m.delete_if(store, m.lost_key(node), seen)
    since = {}
    for node in sorted(cookies - registered):
        mark: Versioned | None = marks.get(node)
        if mark is None:
            try:
                mark = await store.create(m.lost_key(node), m.encode_since(now_ms))
            except CasConflict as conflict:  # another node or auditor saw it first: its time
                mark = conflict.current or await store.get(m.lost_key(node))
        if mark is not None:
            since[node] = m.decode_since(mark.value)
    return since


@dataclass(frozen=True)
class Dependent:
    """An open ledger whose last ensemble names the node: its writer needs that ensemble."""

    ledger_id: int
    state: str
    stream: str | None
    reachable: int  # nodes of its last ensemble registered now
    ensemble_size: int
    write_quorum: int
    ack_quorum: int


@dataclass
class Member:
    node_id: str
    url: str | None = None
    zone: str | None = None
    registered: bool = False
    read_only: bool = False
    decommissioning: bool = False
    cookie: bool = False
    unregistered_since_ms: int | None = None
    lost_at_ms: int | None = None  # when the lost-node delay is (or was) over
    lost: bool = False
    open_ledgers: list[Dependent] = field(default_factory=list)  # the first ``listed``
    open_ledger_count: int = 0
    streams: list[str] = field(default_factory=list)
    ledgers: int = 0  # ledgers any segment of which names it (copies held there)

    @property
    def state(self) -> str:
        """The one word the page shows: reachability first, then what is asked of it."""
        if self.lost:
            return "lost"
        if not self.registered:
            return "unregistered"
        if self.decommissioning:
            return "decommissioning"
        return "read_only" if self.read_only else "registered"


@dataclass(frozen=True)
class FleetView:
    read_ms: int
    lost_node_delay_s: float
    nodes: list[Member]
    ledgers: int
    at_risk_ledgers: int  # a segment names a node not registered now
    at_risk_open_ledgers: int  # ... and not closed: a writer may need that node


def build(
    now_ms: int,
    lost_node_delay_s: float,
    registered: Iterable[NodeInfo],
    cookies: Iterable[str],
    since: dict[str, int],
    decommissioning: Iterable[str],
    reported_lost: Iterable[str],
    ledgers: Iterable[LedgerMetadata],
    listed: int,
) -> FleetView:
    """The view from what was read (pure: no store); ``listed`` open ledgers per node at most."""
    members: dict[str, Member] = {}

    def member(node_id: str) -> Member:
        return members.setdefault(node_id, Member(node_id))

    up = set()
    for info in registered:
        node = member(info.node_id)
        node.url, node.zone, node.registered = info.url, info.zone, True
        node.read_only = info.state is NodeState.READONLY
        up.add(info.node_id)
    for node_id in cookies:
        member(node_id).cookie = True
    for node_id in decommissioning:
        member(node_id).decommissioning = True
    lost_ids = set(reported_lost)
    for node_id, since_ms in since.items():
        node = member(node_id)
        node.unregistered_since_ms = since_ms
        node.lost_at_ms = since_ms + round(lost_node_delay_s * MS_PER_S)
    for node_id in lost_ids:
        member(node_id)  # the last audit's: listed even when its cookie was retired since
    total = at_risk = at_risk_open = 0
    streams: dict[str, set[str]] = {}
    for meta in ledgers:
        total += 1
        named = {n for s in meta.segments for n in s.ensemble}
        for node_id in named:
            member(node_id).ledgers += 1
        if named - up:
            at_risk += 1
            at_risk_open += not meta.closed
        if meta.closed:
            continue
        ensemble = meta.last_segment.ensemble
        stream = meta.properties.get(STREAM_PROPERTY)
        dependent = Dependent(
            meta.ledger_id,
            meta.state.value,
            stream,
            sum(1 for n in ensemble if n in up),
            meta.ensemble_size,
            meta.write_quorum,
            meta.ack_quorum,
        )
        for node_id in set(ensemble):
            node = member(node_id)
            node.open_ledger_count += 1
            if len(node.open_ledgers) < listed:
                node.open_ledgers.append(dependent)
            if stream is not None:
                streams.setdefault(node_id, set()).add(stream)
    for node in members.values():
        node.streams = sorted(streams.get(node.node_id, ()))
        node.lost = not node.registered and (
            node.node_id in lost_ids or (node.lost_at_ms is not None and now_ms >= node.lost_at_ms)
        )
    return FleetView(
        read_ms=now_ms,
        lost_node_delay_s=lost_node_delay_s,
        nodes=sorted(members.values(), key=lambda n: n.node_id),
        ledgers=total,
        at_risk_ledgers=at_risk,
        at_risk_open_ledgers=at_risk_open,
    )


@dataclass(frozen=True)
class FleetRead:
    """What ``read`` takes from the store; ``build`` makes the view of it (off the loop: a
    cluster's ledger list may be long)."""

    now_ms: int
    registered: list[NodeInfo]
    cookies: list[str]
    since: dict[str, int]
    decommissioning: list[str]
    ledger_values: list[bytes]

    def view(self, lost_node_delay_s: float, listed: int, reported_lost: list[str]) -> FleetView:
        """``reported_lost``: the lost nodes of the last audit report (its reader's to decode:
        node/replication/fleet.py keeps what it could read of reports of other versions)."""
        return build(
            self.now_ms,
            lost_node_delay_s,
            self.registered,
            self.cookies,
            self.since,
            self.decommissioning,
            reported_lost,
            _ledgers(self.ledger_values),
            listed,
        )


def _ledgers(values: list[bytes]) -> Iterable[LedgerMetadata]:
    for value in values:
        try:
            yield decode(value)
        except MetadataFormatError:
            continue  # the auditor refuses it loudly; the page shows the rest


async def read(store: MetadataStore, now_ms: int | None = None) -> FleetRead:
    """One read of the keys the view needs (sightings recorded on the way)."""
    now = int(time.time() * MS_PER_S) if now_ms is None else now_ms
    nodes = _names(await store.range(NODES_PREFIX), NODES_PREFIX)
    registered = []
    for versioned in nodes.values():
        try:
            registered.append(NodeInfo.decode(versioned.value))
        except MetadataFormatError:
            continue  # the registry skips it too
    cookies = list(_names(await store.range(COOKIES_PREFIX), COOKIES_PREFIX))
    since = await _note(store, now, set(nodes), set(cookies))
    decommissioning = list(
        _names(await store.range(DECOMMISSIONING_PREFIX), DECOMMISSIONING_PREFIX)
    )
    ledgers = [versioned.value for _key, versioned in await store.range(LEDGERS_PREFIX)]
    return FleetRead(
        now,
        registered,
        cookies,
        since,
        decommissioning,
        ledgers,
    )
