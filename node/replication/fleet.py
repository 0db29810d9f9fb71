"""The fleet's autorecovery seen from one node: every ``autorecovery_poll_s`` the node reads
the auditor's last report (``autorecovery/auditor``), the re-replication totals
(``autorecovery/totals``) and the registered nodes (``nodes/``) from its metadata store, for
its metrics and its status page, and notes the nodes it sees unregistered
(node.autorecovery.fleet: the same first sighting the auditor records). The status page's fleet
view (every node the store knows and the open ledgers that name it) is read when asked for and
reused ``status_fleet_cache_s``: it reads every ledger's metadata. A summary waits for a read
it started one second at most, then answers with the last view (a store that does not answer
must not make the page think the node is down).

The figures are the store's, not this node's: every node exports the same values, so the
metrics stay right whichever node Prometheus scrapes and whichever node the DAG's tasks ran
on, and they change only when an audit or a worker changes the keys (BookKeeper #4563: an
auditor's gauges that only its own process updated went stale when another bookie became
auditor). A read that fails (unreachable store, timeout, a value that does not decode) keeps
the last values and counts ``storage_node_autorecovery_poll_errors_total``; a key or field
that is absent (no audit has run yet, a report of another version) leaves its figures as
they were.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from node.autorecovery.fleet import FleetView, Member, note_unregistered
from node.autorecovery.fleet import read as read_fleet
from node.autorecovery.markers import AUDITOR_KEY, TOTALS_KEY
from node.client.errors import ClientError
from node.client.metadata.store import MetadataStore
from node.client.model import NODES_PREFIX, MetadataFormatError, NodeInfo
from node.metrics import MS_PER_S, FleetFigures
from node.replication.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# Open ledgers listed per node in the fleet view (the count is given in full): a node of a
# large fleet may be in thousands of ensembles, and the page is polled every two seconds.
LEDGERS_LISTED = 20
# A view that took t seconds to read and build is reused for at least this many times t: on a
# fleet of 100,000 ledgers a build takes seconds of CPU, which a 5 s cache would repeat
# without pause while a page is open; this keeps it under a tenth of one core.
READ_COST_FACTOR = 10
# How long the status summary waits for a fresh fleet view before it answers with the last
# one: well inside the page's poll timeout (3 s) when the store does not answer.
VIEW_WAIT_S = 1.0


@dataclass(frozen=True)
class FleetNode:
    node_id: str
    zone: str
    state: str
    url: str


class FleetPoller:
    def __init__(
        self,
        store: MetadataStore,
        figures: FleetFigures,
        interval_s: float,
        timeout_s: float,
        lost_node_delay_s: float,
        view_cache_s: float,
    ) -> None:
        self._store = store
        self.figures = figures
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._lost_node_delay_s = lost_node_delay_s
        self._view_cache_s = view_cache_s
        self._view: FleetView | None = None
        self._view_read_at: float | None = None  # monotonic: when the view was last tried
        self._view_reuse_s = view_cache_s  # the cache, or longer after a costly read
        self._view_reading: asyncio.Task[None] | None = None  # one read at a time, shared
        self.view_error: str | None = None  # of the last read of the view
        self._task: asyncio.Task[None] | None = None
        self.nodes: list[FleetNode] | None = None  # None until nodes/ was read once
        self.decommissioning_nodes = 0
        # Their ids, when the report lists them (the auditor's does): None until then.
        self.lost_node_ids: list[str] | None = None
        self.decommissioning_node_ids: list[str] | None = None
        self.polls = 0
        self.last_poll_ms: int | None = None  # the last read that succeeded
        self.last_error: str | None = None  # of the last read, None when it succeeded

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="autorecovery-poll")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        reading, self._view_reading = self._view_reading, None
        await cancel_and_wait(reading)

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # a bug must not end the polls: the next one tries again
                log.exception("reading the autorecovery keys failed")
            await asyncio.sleep(self._interval_s)

    async def poll(self) -> bool:
        """One read of the three; True when it succeeded (the figures are then current)."""
        self.polls += 1
        try:
            async with asyncio.timeout(self._timeout_s):
                report = await self._store.get(AUDITOR_KEY)
                totals = await self._store.get(TOTALS_KEY)
                nodes = await self._store.range(NODES_PREFIX)
                away = await note_unregistered(self._store, int(time.time() * MS_PER_S))
            parsed_report = _json(report.value) if report is not None else None
            parsed_totals = _json(totals.value) if totals is not None else None
        except (ClientError, TimeoutError, ValueError) as error:
            self.figures.poll_errors += 1
            self.last_error = str(error) or type(error).__name__
            log.warning("autorecovery figures kept (%s)", self.last_error)
            return False
        # Decoded whole before anything is set: a bad value changes no figure.
        if parsed_report is not None:
            self._report(parsed_report)
        if parsed_totals is not None:
            self._totals(parsed_totals)
        self.nodes = sorted(_nodes(nodes), key=lambda n: n.node_id)
        self.figures.unregistered_nodes = len(away)
        self.last_error = None
        self.last_poll_ms = int(time.time() * 1000)
        return True

    def _report(self, report: dict[str, Any]) -> None:
        f = self.figures
        f.under_replicated_ledgers = _count(
            report, "underReplicatedLedgers", f.under_replicated_ledgers
        )
        f.under_replicated_fragments = _count(
            report, "underReplicatedFragments", f.under_replicated_fragments
        )
        f.lost_nodes = _count(report, "lostNodes", f.lost_nodes)
        self.decommissioning_nodes = _count(
            report, "decommissioningNodes", self.decommissioning_nodes
        )
        self.lost_node_ids = _ids(report, "lostNodes", self.lost_node_ids)
        self.decommissioning_node_ids = _ids(
            report, "decommissioningNodes", self.decommissioning_node_ids
        )
        finished = report.get("finishedMs")
        if isinstance(finished, int | float) and not isinstance(finished, bool):
            f.last_run_s = finished / MS_PER_S

    def _totals(self, totals: dict[str, Any]) -> None:
        f = self.figures
        f.rereplicated_fragments = _count(totals, "fragments", f.rereplicated_fragments)
        f.rereplicated_entries = _count(totals, "entries", f.rereplicated_entries)
        f.rereplicated_bytes = _count(totals, "bytes", f.rereplicated_bytes)

    async def view(self) -> FleetView | None:
        """The fleet view, read at most once per ``status_fleet_cache_s`` (a failed read too:
        a store in trouble is not asked more often); None until a read succeeded. A caller
        waits for a read it started ``VIEW_WAIT_S`` at most, then has the last view: the status
        summary must answer while the store does not."""
        tried, reading = self._view_read_at, self._view_reading
        stale = tried is None or time.monotonic() - tried >= self._view_reuse_s
        if stale and (reading is None or reading.done()):
            self._view_read_at = time.monotonic()
            reading = self._view_reading = asyncio.get_running_loop().create_task(
                self._read_view(), name="fleet-view"
            )
        if reading is not None and not reading.done():
            # shield: a caller that gives up (its client hung up) does not end the read
            await asyncio.wait([asyncio.shield(reading)], timeout=VIEW_WAIT_S)
        return self._view

    async def _read_view(self) -> None:
        started = time.monotonic()
        try:
            async with asyncio.timeout(self._timeout_s):
                read = await read_fleet(self._store)
            # Decoding every ledger is CPU work proportional to the fleet: off the loop.
            self._view = await asyncio.to_thread(
                read.view, self._lost_node_delay_s, LEDGERS_LISTED, self.lost_node_ids or []
            )
        except (ClientError, TimeoutError, ValueError) as error:
            self.view_error = str(error) or type(error).__name__
            log.warning("fleet view kept (%s)", self.view_error)
            # A read that waited out a store in trouble cost nothing: asked again next period.
            self._view_reuse_s = self._view_cache_s
            return
        self.view_error = None
        cost = time.monotonic() - started
        self._view_reuse_s = max(self._view_cache_s, READ_COST_FACTOR * cost)

    async def view_summary(self) -> dict[str, Any]:
        """The view as the status summary's ``fleet`` block."""
        view = await self.view()
        return {
            "readMs": view.read_ms if view else None,
            "cacheSeconds": self._view_reuse_s,
            "lostNodeDelaySeconds": self._lost_node_delay_s,
            "ledgers": view.ledgers if view else None,
            "atRiskLedgers": view.at_risk_ledgers if view else None,
            "atRiskOpenLedgers": view.at_risk_open_ledgers if view else None,
            "unregisteredNodes": (sum(1 for n in view.nodes if not n.registered) if view else None),
            "nodes": [_member(n) for n in view.nodes] if view else None,
            "error": self.view_error,
        }

    def summary(self) -> dict[str, Any]:
        f = self.figures
        return {
            "underReplicatedLedgers": f.under_replicated_ledgers,
            "underReplicatedFragments": f.under_replicated_fragments,
            "lostNodes": f.lost_nodes,
            "decommissioningNodes": self.decommissioning_nodes,
            "lostNodeIds": self.lost_node_ids,
            "decommissioningNodeIds": self.decommissioning_node_ids,
            "lastAuditorRunMs": round(f.last_run_s * MS_PER_S)
            if f.last_run_s is not None
            else None,
            "rereplicatedFragments": f.rereplicated_fragments,
            "rereplicatedEntries": f.rereplicated_entries,
            "rereplicatedBytes": f.rereplicated_bytes,
            "nodes": (
                None
                if self.nodes is None
                else [
                    {"id": n.node_id, "zone": n.zone, "state": n.state, "url": n.url}
                    for n in self.nodes
                ]
            ),
            "lastAutorecoveryPollMs": self.last_poll_ms,
            "autorecoveryPollErrors": f.poll_errors,
            "lastAutorecoveryPollError": self.last_error,
        }


def _json(value: bytes) -> dict[str, Any]:
    parsed = json.loads(value)
    if not isinstance(parsed, dict):
        raise ValueError(f"not a JSON object: {value[:80]!r}")
    return parsed


def _count(raw: dict[str, Any], field: str, previous: int) -> int:
    """A count field: an integer, or a list (its length: the auditor may list the nodes);
    absent or of another type: the previous value."""
    value = raw.get(field)
    if isinstance(value, bool):
        return previous
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, list):
        return len(value)
    return previous


def _ids(raw: dict[str, Any], field: str, previous: list[str] | None) -> list[str] | None:
    """A field that lists node ids; a count (or nothing) keeps the previous list."""
    value = raw.get(field)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return sorted(value)
    return previous


def _nodes(found: list[tuple[str, Any]]) -> list[FleetNode]:
    nodes = []
    for _key, versioned in found:
        try:
            info = NodeInfo.decode(versioned.value)
        except MetadataFormatError:
            continue  # the registry skips it too: not a node a client would choose
        nodes.append(FleetNode(info.node_id, info.zone, info.state.value, info.url))
    return nodes


def _member(node: Member) -> dict[str, Any]:
    return {
        "id": node.node_id,
        "state": node.state,
        "url": node.url,
        "zone": node.zone,
        "registered": node.registered,
        "readOnly": node.read_only,
        "decommissioning": node.decommissioning,
        "cookie": node.cookie,
        "unregisteredSinceMs": node.unregistered_since_ms,
        "lostAtMs": node.lost_at_ms,
        "ledgers": node.ledgers,
        "openLedgerCount": node.open_ledger_count,
        "openLedgers": [
            {
                "ledgerId": str(d.ledger_id),
                "state": d.state,
                "stream": d.stream,
                "reachable": d.reachable,
                "ensembleSize": d.ensemble_size,
                "writeQuorum": d.write_quorum,
                "ackQuorum": d.ack_quorum,
            }
            for d in node.open_ledgers
        ],
        "streams": node.streams,
    }
