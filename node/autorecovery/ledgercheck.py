"""The ledger check (BookKeeper's LedgerChecker, run by its auditor every
``auditorPeriodicCheckInterval``): each replica of each settled fragment says, from its index,
which ids of the fragment it lacks; no payload is read, so it is cheap enough for every
audit, where the replicas check (replicas.py) reads every entry and runs daily.

A fragment is (ledger, segment, node): the ids of the segment whose write set holds the
node, a stripe (node/client/stripes.py) the node is asked about in one request per
thousand missing ranges (GET /api/v1/ledgers/{lid}/missing). A node that does not know the
ledger lacks all of it. Only settled ids are asked about (replicas.entry_range: every id of a
CLOSED ledger, the segments of an OPEN one before its last): past them a writer may still be
adding, and a replica behind the LAC of an open ledger is its writer's to replace. A node
that does not answer (down, slow, not registered) is no finding, as in the replicas check:
the lost-node rule covers a node that stays away.

Why it is needed: a writer completes an add at Qa and may close its ledger before a slow
replica's add fails, so nothing resends those entries; the replica stays short of a CLOSED
ledger, its copies at Qa of Qw, until an auditor finds it. The auditor marks such a node
"missing", and the worker copies exactly the missing entries onto it (worker.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from node.autorecovery.replicas import entry_range
from node.client.bookies import within
from node.client.errors import ReplicaError
from node.client.model import LedgerMetadata
from node.client.stripes import IdRange, Stripe

if TYPE_CHECKING:
    from node.client.client import Client

# Fragments asked about at once, over every ledger: each is one small request to one node.
CHECK_WINDOW = 32


@dataclass(frozen=True)
class Fragment:
    meta: LedgerMetadata
    index: int  # the segment's
    node: str

    @property
    def ids(self) -> range:
        return entry_range(self.meta, self.index)

    @property
    def stripe(self) -> Stripe:
        position = self.meta.segments[self.index].ensemble.index(self.node)
        return Stripe(self.meta.ensemble_size, self.meta.write_quorum, position)


@dataclass
class LedgerCheck:
    """One check's findings: node -> missing entries, per ledger; what it covered."""

    short: dict[int, dict[str, int]] = field(default_factory=dict)
    fragments: int = 0  # fragments whose replica answered
    entries: int = 0  # ids those replicas were asked about (held or missing)
    unanswered: int = 0  # fragments whose replica did not answer

    @property
    def missing_entries(self) -> int:
        return sum(sum(nodes.values()) for nodes in self.short.values())


def fragments(meta: LedgerMetadata, skip: Collection[str] = ()) -> Iterable[Fragment]:
    """The settled fragments of ``meta`` that hold an id, but on nodes in ``skip``."""
    for index, segment in enumerate(meta.segments):
        ids = entry_range(meta, index)
        for node in segment.ensemble:
            fragment = Fragment(meta, index, node)
            if node not in skip and ids and fragment.stripe.count(ids.start, ids.stop - 1):
                yield fragment


async def missing_ranges(client: Client, fragment: Fragment) -> AsyncIterator[IdRange]:
    """The ranges of the fragment's ids its node lacks, ascending, asking page by page; all
    of them when the node does not know the ledger. ReplicaError when it does not answer."""
    ids, stripe = fragment.ids, fragment.stripe
    node, ledger_id = fragment.node, fragment.meta.ledger_id
    at: int | None = ids.start
    last = ids.stop - 1
    while at is not None:
        try:
            answer = await within(
                node,
                client.transport.missing(node, ledger_id, at, last, stripe),
                client.read_timeout_s,
            )
        except ReplicaError as error:
            if not error.absent:
                raise
            for found in stripe.ranges(at, last):
                yield found
            return
        for found in answer.missing:
            yield found
        at = answer.next_from


async def _short_of(client: Client, fragment: Fragment) -> int | None:
    """How many of the fragment's ids its node lacks; None when it did not answer."""
    try:
        return sum([high - low + 1 async for low, high in missing_ranges(client, fragment)])
    except ReplicaError:
        return None


async def check_ledgers(
    client: Client, metas: Iterable[LedgerMetadata], skip: Collection[str] = ()
) -> LedgerCheck:
    """Ask every replica of every settled fragment of ``metas`` what it lacks; nodes in
    ``skip`` (lost or decommissioning: marked already) are not asked."""
    result = LedgerCheck()
    todo = [fragment for meta in metas for fragment in fragments(meta, skip)]
    for start in range(0, len(todo), CHECK_WINDOW):
        chunk = todo[start : start + CHECK_WINDOW]
        answers = await asyncio.gather(*(_short_of(client, f) for f in chunk))
        for fragment, short in zip(chunk, answers, strict=True):
            if short is None:
                result.unanswered += 1
                continue
            result.fragments += 1
            ids = fragment.ids
            result.entries += fragment.stripe.count(ids.start, ids.stop - 1)
            if short:
                nodes = result.short.setdefault(fragment.meta.ledger_id, {})
                nodes[fragment.node] = nodes.get(fragment.node, 0) + short
    return result
