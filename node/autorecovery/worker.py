"""The replication worker (BookKeeper's ReplicationWorker), for one marker: lock it, move each
fragment of a marked node to a replacement, CAS the segment's ensemble, and unmark. A node
marked "missing" keeps its place: the entries of its settled fragments that it lacks (it says
which, from its index: ledgercheck.py) are copied onto it the same way, and it is unmarked.

A fragment is (ledger, segment, node): the segment's entries whose write set holds the node. Its
copy, ``COPY_BATCH`` entries at a time: each entry is read from every other replica of its write
set that is not itself marked (their CRC32C must agree: a second replica vouches for the bytes),
added to the replacement as a recovery add (it passes a fence; the same bytes again are 201, so
a rerun after a crash repeats the copy harmlessly), and read back from it and compared. Only
then the ledger's metadata is CAS-changed (the update loop re-checks that the node is still in
its place; a writer's concurrent ensemble change only appends or replaces the last segment, never
the one copied) in the same commit as the increment of ``autorecovery/totals`` (so a fragment
copied twice is counted once, and a worker killed after its CAS leaves no fragment uncounted),
and the marker loses the node once no segment names it.

The lock is ``underreplicated-locks/<id>`` under a lease of ``lock_ttl_s`` kept alive while the
worker runs: a worker that dies loses it within the TTL, and a worker whose lease ends (a pause,
a partition from the store) stops at once, before any CAS (LockLost).

The last segment of a ledger that is not CLOSED is not settled: its writer may still add to it.
Such a ledger waits ``open_ledger_grace_s`` from the marker's creation (its writer may replace
the node itself, BookKeeper's openLedgerRereplicationGracePeriod), then it is fenced and
recovered (closed) and its last segment is copied like any other."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from crc32c import crc32c

from node.autorecovery import ledgercheck
from node.autorecovery import markers as m
from node.autorecovery.markers import Lock, Marker, Reason
from node.autorecovery.replicas import fragment_entries
from node.client.bookies import within
from node.client.errors import CasConflict, ClientError, MetadataError, NoSuchKey, ReplicaError
from node.client.metadata.loop import read_with_retry
from node.client.model import LedgerMetadata, Segment, decode, encode, ledger_key
from node.client.placement import choose_replacement
from node.client.stripes import IdRange

if TYPE_CHECKING:
    from node.client.client import Client

log = logging.getLogger(__name__)

# Entries of a fragment read, added to the replacement and read back together.
COPY_BATCH = 64

DONE = "done"  # no marked node is in the ledger any more; the marker is deleted
LOCKED = "locked"  # another worker holds the marker's lock
WAITING = "waiting"  # an open ledger within its grace period (only with wait=False)
GONE = "gone"  # no marker (done by someone else), or the ledger was deleted


class Steps(Protocol):
    """Named steps a test may crash or stall at (a node passes its ``Faults``)."""

    def hit(self, name: str) -> None: ...


class _NoSteps:
    def hit(self, name: str) -> None:
        pass


NO_STEPS: Steps = _NoSteps()


class LockLost(ClientError):
    """The marker's lock lease ended while this worker ran: it stopped, changing nothing more."""

    code = "lock_lost"


class FragmentFailed(ClientError):
    """A fragment could not be copied (its replicas disagree, none returned an entry, the
    replacement did not keep it): the marker stays for a later run."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ReplicationResult:
    ledger_id: int
    outcome: str
    fragments: int = 0
    entries: int = 0
    size: int = 0  # payload bytes ("bytes" in the JSON)

    def to_json(self) -> dict[str, Any]:
        return {
            "ledgerId": self.ledger_id,
            "outcome": self.outcome,
            "fragments": self.fragments,
            "entries": self.entries,
            "bytes": self.size,
        }


class _Lease:
    """The lock's lease, kept alive every third of its TTL; ``lost`` once it cannot be."""

    def __init__(
        self, client: Client, ledger_id: int, worker_id: str, lease: int, ttl_s: int
    ) -> None:
        self.client, self.ledger_id, self.worker_id = client, ledger_id, worker_id
        self.lease, self.ttl_s = lease, ttl_s
        self.lost = asyncio.Event()

    async def keep(self) -> None:
        """Renew the lease and look at the lock's key: an operator who deletes it (or a lease
        that ended) stops the copy within a third of the TTL."""
        renewed = time.monotonic()
        key = m.lock_key(self.ledger_id)
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                if not await self.client.store.keepalive(self.lease):
                    break
                renewed = time.monotonic()
                found = await self.client.store.get(key)
                if found is None or Lock.decode(found.value).worker != self.worker_id:
                    break
            except MetadataError:
                if time.monotonic() - renewed >= self.ttl_s:
                    break
        self.lost.set()

    async def check(self) -> None:
        """LockLost unless the lock is still this worker's: asked right before every change."""
        found = None
        with contextlib.suppress(MetadataError):
            found = await self.client.store.get(m.lock_key(self.ledger_id))
        if self.lost.is_set() or found is None or Lock.decode(found.value).worker != self.worker_id:
            self.lost.set()
            raise LockLost(
                f"ledger {self.ledger_id}: the marker's lock is no longer {self.worker_id}'s"
            )


async def rereplicate(
    client: Client,
    ledger_id: int,
    *,
    worker_id: str,
    open_ledger_grace_s: float,
    lock_ttl_s: int,
    wait: bool = True,
    faults: Steps = NO_STEPS,
) -> ReplicationResult:
    """Re-replicate what the ledger's marker names. ``wait=False``: an open ledger within its
    grace period answers WAITING instead of sleeping through it. ``faults.hit`` is called at
    each step a test may crash at: ``autorecovery.after_copy``, a fragment copied and read
    back, its CAS not sent."""
    store = client.store
    if await read_with_retry(store, m.marker_key(ledger_id)) is None:
        return ReplicationResult(ledger_id, GONE)
    lease_id = await store.grant_lease(lock_ttl_s)
    try:
        await store.create(
            m.lock_key(ledger_id), Lock(worker_id, int(time.time() * 1000)).encode(), lease=lease_id
        )
    except CasConflict:
        with contextlib.suppress(MetadataError):
            await store.revoke(lease_id)
        return ReplicationResult(ledger_id, LOCKED)
    except BaseException:  # a lost answer may have put the lock: it goes with the lease
        with contextlib.suppress(MetadataError):
            await store.revoke(lease_id)
        raise
    lease = _Lease(client, ledger_id, worker_id, lease_id, lock_ttl_s)
    keeper = asyncio.create_task(lease.keep())
    result = ReplicationResult(ledger_id, DONE)
    work = asyncio.create_task(_work(client, lease, result, open_ledger_grace_s, wait, faults))
    lost = asyncio.create_task(lease.lost.wait())
    try:
        await asyncio.wait({work, lost}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the lease ended mid-copy: stop now, before any CAS
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, ClientError):
                await work
            raise LockLost(f"ledger {ledger_id}: the marker's lock lease ended")
        return work.result()
    finally:
        for task in (keeper, lost, work):
            task.cancel()
        await asyncio.gather(keeper, lost, work, return_exceptions=True)
        with contextlib.suppress(MetadataError):
            await store.revoke(lease_id)


async def _work(
    client: Client,
    lease: _Lease,
    result: ReplicationResult,
    grace_s: float,
    wait: bool,
    faults: Steps,
) -> ReplicationResult:
    store, ledger_id = client.store, result.ledger_id
    recovered = False
    while True:
        found = await read_with_retry(store, ledger_key(ledger_id))
        marked = await read_with_retry(store, m.marker_key(ledger_id))
        if marked is None:
            return result
        marker = Marker.decode(marked.value)
        if found is None:
            await lease.check()
            await m.delete_if(store, m.marker_key(ledger_id), marked)
            result.outcome = GONE
            return result
        meta = decode(found.value)
        short = sorted(n for n, r in marker.nodes.items() if r is Reason.MISSING)
        if short:  # the node keeps its place: copy onto it what it lacks
            await _fill(client, lease, meta, short[0], marker, result)
            continue
        todo = [
            (index, node)
            for index, segment in enumerate(meta.segments)
            for node in segment.ensemble
            if node in marker.nodes
        ]
        if not todo:
            await lease.check()
            await _unmark(client, ledger_id, marker.nodes.keys())
            return result
        last = len(meta.segments) - 1
        settled = [(i, n) for i, n in todo if meta.closed or i != last]
        if settled:  # an open ledger's older segments first: they need no fence
            index, node = settled[0]
            with contextlib.suppress(NoSuchKey):  # deleted meanwhile: the next turn sees it
                await _move(client, lease, meta, index, node, marker, result, faults)
            continue
        remaining_s = marker.created_ms / 1000 + grace_s - time.time()
        if remaining_s > 0 and not recovered:
            if not wait:
                result.outcome = WAITING
                return result
            await asyncio.sleep(remaining_s)
        await lease.check()
        await client.recover_ledger(ledger_id)  # fence and close: its end is settled
        recovered = True


async def _unmark(client: Client, ledger_id: int, nodes: Collection[str]) -> None:
    """Remove ``nodes`` from the marker; delete it when none is left."""
    key = m.marker_key(ledger_id)
    current = await read_with_retry(client.store, key)
    while current is not None:
        marker = Marker.decode(current.value)
        kept = {n: r for n, r in marker.nodes.items() if n not in nodes}
        try:
            if not kept:
                await client.store.delete(key, current.revision)
            elif kept != marker.nodes:
                await client.store.cas(
                    key, Marker(ledger_id, kept, marker.created_ms).encode(), current.revision
                )
            return
        except CasConflict as conflict:
            current = conflict.current or await read_with_retry(client.store, key)
        except NoSuchKey:
            return


async def _avoid(client: Client, marker: Marker) -> set[str]:
    """Nodes no replacement may be: the marked ones and the decommissioning. A ``lost/`` mark
    is not one: it records when a node was first seen unregistered, and placement only ever
    picks registered nodes, so the mark of a node registered again (kept until an audit sees
    it back) would only have kept a live node out."""
    prefix = m.DECOMMISSIONING_PREFIX
    leaving = {key.removeprefix(prefix) for key, _v in await client.store.range(prefix)}
    return set(marker.nodes) | leaving


async def _source(
    client: Client, meta: LedgerMetadata, entry_id: int, node: str, marker: Marker
) -> bytes:
    """The entry's bytes from the other replicas of its write set (all that answer must agree):
    not the marked ones but those only short of entries (what they hold is good); a
    decommissioning node's own copy only when no other replica has it."""
    others = [
        n
        for n in meta.write_set(entry_id)
        if n != node and marker.nodes.get(n, Reason.MISSING) is Reason.MISSING
    ]

    async def read(replica: str) -> bytes | ReplicaError:
        try:
            return await within(
                replica,
                client.transport.read_entry(replica, meta.ledger_id, entry_id, fence=False),
                client.read_timeout_s,
            )
        except ReplicaError as error:
            return error

    answers = await asyncio.gather(*(read(n) for n in others))
    payloads = [a for a in answers if isinstance(a, bytes)]
    if len({crc32c(p) for p in payloads}) > 1:
        raise FragmentFailed(
            "replicas_disagree",
            f"ledger {meta.ledger_id} entry {entry_id}: replicas {others} hold different bytes",
        )
    if not payloads and marker.nodes.get(node) is Reason.DECOMMISSIONING:
        own = await read(node)
        if isinstance(own, bytes):
            return own
    if not payloads:
        errors = {
            n: a.code for n, a in zip(others, answers, strict=True) if isinstance(a, ReplicaError)
        }
        raise FragmentFailed(
            "entry_unavailable",
            f"ledger {meta.ledger_id} entry {entry_id}: no replica returned it ({errors})",
        )
    return payloads[0]


async def _copy(
    client: Client,
    meta: LedgerMetadata,
    node: str,
    marker: Marker,
    target: str,
    batch: list[int],
) -> int:
    """Copy entries ``batch`` of ``node``'s fragments onto ``target`` (a replacement, or the
    node itself when it only lacks them): read from the other replicas, added as a recovery
    add, read back and compared. Returns the payload bytes copied."""
    replication = (meta.ensemble_size, meta.write_quorum, meta.ack_quorum)
    # The LAC a copy carries: a CLOSED ledger's end; an OPEN one's older segments claim none.
    lac, lac_length = (meta.last_entry_id, meta.length) if meta.closed else (-1, 0)
    payloads = await asyncio.gather(*(_source(client, meta, e, node, marker) for e in batch))
    pairs = list(zip(batch, payloads, strict=True))
    await within(
        target,
        client.transport.add(
            target,
            meta.ledger_id,
            pairs,
            lac=lac,
            lac_length=lac_length,
            replication=replication,
            recovery=True,
        ),
        client.add_timeout_s,
    )
    back = await asyncio.gather(
        *(
            within(
                target,
                client.transport.read_entry(target, meta.ledger_id, e, fence=False),
                client.read_timeout_s,
            )
            for e in batch
        )
    )
    for (entry_id, payload), stored in zip(pairs, back, strict=True):
        if crc32c(stored) != crc32c(payload):
            raise FragmentFailed(
                "copy_mismatch",
                f"ledger {meta.ledger_id} entry {entry_id}: {target} returned other bytes",
            )
    return sum(len(p) for p in payloads)


async def _batches(ranges: AsyncIterator[IdRange]) -> AsyncIterator[list[int]]:
    """The ids of ``ranges``, COPY_BATCH at a time (a wiped node's fragment is never one
    list of every id)."""
    batch: list[int] = []
    async for low, high in ranges:
        for entry_id in range(low, high + 1):
            batch.append(entry_id)
            if len(batch) == COPY_BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


async def _fill(
    client: Client,
    lease: _Lease,
    meta: LedgerMetadata,
    node: str,
    marker: Marker,
    result: ReplicationResult,
) -> None:
    """Copy onto ``node`` the entries of its settled fragments that it lacks (it says which,
    from its index), then take it off the marker, counted in the same commit. Its unsettled
    fragment, the last segment of an OPEN ledger, is its writer's."""
    entries = size = fragments = 0
    for fragment in ledgercheck.fragments(meta):
        if fragment.node != node:
            continue
        copied = 0
        async for batch in _batches(ledgercheck.missing_ranges(client, fragment)):
            size += await _copy(client, meta, node, marker, node, batch)
            copied += len(batch)
        entries += copied
        fragments += 1 if copied else 0
    ledger_id = meta.ledger_id

    def needs(raw: bytes) -> bool:
        return Marker.decode(raw).nodes.get(node) is Reason.MISSING

    def transform(raw: bytes) -> bytes | None:
        old = Marker.decode(raw)
        kept = {n: r for n, r in old.nodes.items() if n != node}
        return Marker(ledger_id, kept, old.created_ms).encode() if kept else None

    await lease.check()
    with contextlib.suppress(NoSuchKey):  # done by another worker meanwhile
        await m.swap_counted(
            client.store,
            m.marker_key(ledger_id),
            needs,
            transform,
            m.Totals(fragments, entries, size),
        )
    result.fragments += fragments
    result.entries += entries
    result.size += size
    log.info("ledger %d: %d entries copied onto %s, which lacked them", ledger_id, entries, node)


async def _move(
    client: Client,
    lease: _Lease,
    meta: LedgerMetadata,
    index: int,
    node: str,
    marker: Marker,
    result: ReplicationResult,
    faults: Steps,
) -> None:
    """Copy the fragment (meta, index, node) to a replacement and CAS it into the segment."""
    segment = meta.segments[index]
    position = segment.ensemble.index(node)
    replacement = choose_replacement(
        await client.registry.candidates(),
        segment.ensemble,
        node,
        client.rng,
        exclude=await _avoid(client, marker),
    )
    entries = list(fragment_entries(meta, index, node))
    copied = 0
    for start in range(0, len(entries), COPY_BATCH):
        batch = entries[start : start + COPY_BATCH]
        copied += await _copy(client, meta, node, marker, replacement, batch)

    first = segment.first_entry_id

    def needs(raw: bytes) -> bool:
        now = decode(raw)
        return (
            index < len(now.segments)
            and now.segments[index].first_entry_id == first
            and now.segments[index].ensemble[position] == node
        )

    def transform(raw: bytes) -> bytes:
        now = decode(raw)
        ensemble = list(now.segments[index].ensemble)
        ensemble[position] = replacement
        segments = list(now.segments)
        segments[index] = Segment(first, tuple(ensemble))
        return encode(now.evolve(segments=tuple(segments)))

    faults.hit("autorecovery.after_copy")
    await lease.check()
    counted = m.Totals(1, len(entries), copied)
    raw = await m.swap_counted(client.store, ledger_key(meta.ledger_id), needs, transform, counted)
    after = None if raw is None else decode(raw)
    if (
        after is not None
        and index < len(after.segments)
        and after.segments[index].ensemble[position] == replacement
    ):
        result.fragments += 1
        result.entries += len(entries)
        result.size += copied
        log.info(
            "ledger %d segment %d: %s replaced by %s (%d entries)",
            meta.ledger_id,
            index,
            node,
            replacement,
            len(entries),
        )
