"""Recovery of a ledger whose writer is gone or presumed gone (BookKeeper's LedgerRecoveryOp with
ReadLastConfirmedOp): decide where the ledger ends so every reader agrees, keeping every entry
the writer acknowledged.

1. CAS the metadata OPEN -> IN_RECOVERY (a writer's ensemble change or close now fails).
2. Fencing LAC reads to the last segment's ensemble, until they cover it: after that the old
   writer can no longer reach Qa acknowledgements for a new entry.
3. Start after max(highest LAC answered, last segment's first entry - 1) (BookKeeper #2615: never
   before the current segment, whose nodes are the only ones asked).
4. Read forward with *fencing* reads to each entry's write set (BookKeeper #2614: the fence lands
   on a replica before it says "no such entry", so the old writer cannot complete the entry
   there afterwards). Present if any replica returns it: re-added to its whole write set, done
   at Qa durable copies (BookKeeper's recovery adds): a paused replica holds nothing up, its
   copy goes on in the background and a copy it never makes is the auditor's to repair.
   Absent only when Qw-Qa+1 replicas say the index has no such entry or ledger; any other
   answer aborts (BookKeeper #2908: an error is not "absent").
5. CAS-close at the last entry kept (another recoverer closed first: its end, the same one),
   on the metadata as it is then, with only the recovery's own segments put in (BookKeeper's
   closeRecovered): a re-replication that swapped a node of an older segment meanwhile stays.

A RecoveryFailed leaves the ledger IN_RECOVERY; running recovery again resumes it."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from node.client.bookies import within
from node.client.errors import (
    ClientError,
    NoSuchLedger,
    NotEnoughNodes,
    ReadFailed,
    RecoveryFailed,
    ReplicaError,
)
from node.client.metadata.loop import read_with_retry, update
from node.client.metadata.store import Versioned
from node.client.metrics import RECOVERIES, RECOVERY_READDS_SHORT
from node.client.model import LedgerMetadata, LedgerState, Segment, decode, encode, ledger_key
from node.client.placement import choose_replacement
from node.client.reader import read_entry, read_lac_coverage

if TYPE_CHECKING:
    from node.client.session import Session as Client  # what it needs of client.Client

log = logging.getLogger(__name__)

# A test hook: awaited at "in_recovery", "lac_read", "entry" (before each entry's reads, info
# has "entry_id") and "close", so a test can change the network between phases.
PhaseHook = Callable[[str, dict[str, Any]], Awaitable[None]]


async def _no_hook(phase: str, info: dict[str, Any]) -> None:
    pass


async def recover(client: Client, ledger_id: int, on_phase: PhaseHook | None = None) -> Versioned:
    """Recover ``ledger_id`` and return its CLOSED metadata (at once when CLOSED already)."""
    hook = on_phase or _no_hook
    key = ledger_key(ledger_id)
    current = await read_with_retry(client.store, key)
    if current is None:
        raise NoSuchLedger(ledger_id)
    if decode(current.value).closed:
        RECOVERIES.labels("already_closed").inc()
        return current
    try:
        closed = await _recover(client, ledger_id, current, hook)
    except ClientError:
        RECOVERIES.labels("failed").inc()
        raise
    RECOVERIES.labels("closed").inc()
    return closed


async def _recover(
    client: Client, ledger_id: int, current: Versioned, hook: PhaseHook
) -> Versioned:
    key = ledger_key(ledger_id)
    current = await update(
        client.store,
        key,
        current,
        lambda raw: decode(raw).state is LedgerState.OPEN,
        lambda raw: encode(decode(raw).evolve(state=LedgerState.IN_RECOVERY)),
    )
    meta = decode(current.value)
    if meta.closed:
        return current
    await hook("in_recovery", {"ledger_id": ledger_id})

    answers = await read_lac_coverage(
        client, meta, fence=True, timeout_s=client.recovery_timeout_s, failure=RecoveryFailed
    )
    best = max(answers.values(), key=lambda a: a.lac)
    lac, length = best.lac, best.lac_length
    last_segment = meta.last_segment
    start = max(lac, last_segment.first_entry_id - 1)
    await hook(
        "lac_read",
        {
            "ledger_id": ledger_id,
            "lac": lac,
            "start": start,
            "answers": {n: a.lac for n, a in answers.items()},
        },
    )
    # Entries between the replicas' LAC and the last segment were confirmed before the ensemble
    # changed: only their sizes are needed (the length), read from the current nodes first.
    for entry_id in range(lac + 1, start + 1):
        try:
            length += len(await read_entry(client, meta, entry_id, last_segment.ensemble))
        except ReadFailed as error:
            raise RecoveryFailed(f"ledger {ledger_id}: {error}") from error

    last = start
    written = meta  # where recovered entries go: the last ensemble, failed nodes swapped out
    # Reads of the next entries go out ahead (a window), decisions are taken in order. With a
    # hook, one entry at a time: the hook runs before that entry's reads.
    window = 1 if hook is not _no_hook else client.recovery_read_window
    ahead: deque[asyncio.Task[bytes | None]] = deque()
    next_id = start + 1
    try:
        while True:
            while len(ahead) < window:
                await hook("entry", {"ledger_id": ledger_id, "entry_id": next_id})
                ahead.append(client._spawn(_decide(client, meta, next_id)))
                next_id += 1
            payload = await ahead.popleft()
            if payload is None:
                break
            batch = [(last + 1, payload)]
            size = len(payload)
            # The entries decided already go back with it, in one request per node.
            while ahead and ahead[0].done() and len(batch) < client.max_request_entries:
                following = ahead[0].result()
                if following is None or size + len(following) > client.max_request_bytes:
                    break
                ahead.popleft()
                batch.append((last + 1 + len(batch), following))
                size += len(following)
            # The re-adds carry the LAC the replicas had, not the recovered one: a recovery
            # that fails later (its segments unwritten) must leave no LAC claim that a rerun
            # would trust over entries it re-added only on nodes the metadata does not name.
            written = await _write_back_batch(client, written, batch, best.lac, best.lac_length)
            length += size
            last = batch[-1][0]
    finally:
        for task in ahead:  # past the end: their answers no longer matter
            task.cancel()

    await hook("close", {"ledger_id": ledger_id, "last_entry_id": last, "length": length})
    # The segments this recovery made (nodes replaced from a recovered entry on): a suffix.
    own = tuple(s for s in written.segments if s not in meta.segments)

    def needs(raw: bytes) -> bool:
        return decode(raw).state is LedgerState.IN_RECOVERY

    def transform(raw: bytes) -> bytes:
        found = decode(raw)
        segments = found.segments
        if own:
            first = own[0].first_entry_id
            if found.last_segment.first_entry_id > first:  # nobody adds one while IN_RECOVERY
                raise RecoveryFailed(
                    f"ledger {ledger_id}: a segment from {found.last_segment.first_entry_id} "
                    f"appeared during the recovery (its own start at {first})"
                )
            segments = (*(s for s in segments if s.first_entry_id < first), *own)
        return encode(
            found.evolve(
                state=LedgerState.CLOSED,
                last_entry_id=last,
                length=length,
                closed_ms=int(time.time() * 1000),
                segments=segments,
            )
        )

    # Closed by another recoverer meanwhile: its end is ours (both read fenced replicas).
    return await update(client.store, key, current, needs, transform)


async def _decide(client: Client, meta: LedgerMetadata, entry_id: int) -> bytes | None:
    """The entry's bytes if any replica returns it, None when enough replicas say it is absent;
    RecoveryFailed otherwise."""
    nodes = meta.write_set(entry_id)
    fence = not client.unsafe_unfenced_recovery_reads
    absent_needed = meta.write_quorum - meta.ack_quorum + 1
    absent: list[str] = []
    errors: dict[str, str] = {}

    async def ask(node: str) -> bytes:
        return await within(
            node,
            client.transport.read_entry(node, meta.ledger_id, entry_id, fence=fence),
            client.recovery_timeout_s,
        )

    pending = {client._spawn(ask(node)): node for node in nodes}
    while pending:
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            node = pending.pop(task)
            error = task.exception()
            if error is None:
                return task.result()
            if isinstance(error, ReplicaError) and error.absent:
                absent.append(node)
            else:
                errors[node] = getattr(error, "code", repr(error))
        if len(absent) >= absent_needed:
            return None
    raise RecoveryFailed(
        f"ledger {meta.ledger_id} entry {entry_id}: neither present nor absent "
        f"(absent on {absent}, {absent_needed} needed; unknown {errors})"
    )


async def _write_back_batch(
    client: Client, meta: LedgerMetadata, entries: list[tuple[int, bytes]], lac: int, length: int
) -> LedgerMetadata:
    """Re-add consecutive recovered entries: all at once, one request per node of their
    write sets, done once each entry has Qa copies (the rest go on in the background, as
    ``_write_back``'s); at the first node that fails, one by one through ``_write_back``,
    which replaces failed nodes (re-adding an entry twice stores the same bytes)."""
    if len(entries) > 1 and await _put_together(client, meta, entries, lac, length):
        return meta
    for entry_id, payload in entries:
        meta = await _write_back(client, meta, entry_id, payload, lac, length)
    return meta


async def _put_together(
    client: Client, meta: LedgerMetadata, entries: list[tuple[int, bytes]], lac: int, length: int
) -> bool:
    """Whether every entry reached Qa copies with no node failing."""
    replication = (meta.ensemble_size, meta.write_quorum, meta.ack_quorum)
    groups: dict[str, list[tuple[int, bytes]]] = {}
    for entry in entries:
        for node in meta.write_set(entry[0]):
            groups.setdefault(node, []).append(entry)
    asking = {
        client._spawn(
            within(
                node,
                client.transport.add(
                    node,
                    meta.ledger_id,
                    group,
                    lac=lac,
                    lac_length=length,
                    replication=replication,
                    recovery=True,
                ),
                client.recovery_timeout_s,
            )
        ): node
        for node, group in groups.items()
    }
    write_sets = [set(meta.write_set(entry_id)) for entry_id, _ in entries]
    stored: set[str] = set()
    while any(len(nodes & stored) < meta.ack_quorum for nodes in write_sets):
        done, _ = await asyncio.wait(asking, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            node = asking.pop(task)
            if task.exception() is not None:
                return False  # the requests still out finish on their own
            stored.add(node)
    first = entries[0][0]
    for task, node in asking.items():
        task.add_done_callback(functools.partial(_late, meta.ledger_id, first, node))
    return True


async def _write_back(
    client: Client, meta: LedgerMetadata, entry_id: int, payload: bytes, lac: int, length: int
) -> LedgerMetadata:
    """Re-add a recovered entry to its write set (a recovery add passes the fence): done once Qa
    nodes of the final write set hold it durably (BookKeeper's recovery adds complete at Qa).
    The adds still out then go on in the background, each within ``recovery_timeout_s`` (the
    client's close stops them); a copy that fails there is left to the auditor. Only failures
    that put Qa out of reach replace the failed nodes, for this entry and the ones after it (a
    recovery segment, written into the metadata with the close, BookKeeper's
    newEnsemblesFromRecovery), once per entry. The metadata to write the next entries by."""
    replication = (meta.ensemble_size, meta.write_quorum, meta.ack_quorum)

    async def put(node: str) -> None:
        await within(
            node,
            client.transport.add(
                node,
                meta.ledger_id,
                [(entry_id, payload)],
                lac=lac,
                lac_length=length,
                replication=replication,
                recovery=True,
            ),
            client.recovery_timeout_s,
        )

    stored: set[str] = set()
    failed: dict[str, str] = {}
    asking: dict[asyncio.Task[None], str] = {}

    def ask(nodes: list[str]) -> None:
        for node in nodes:
            asking[client._spawn(put(node))] = node

    ask(meta.write_set(entry_id))
    swapped = False
    while len(stored) < meta.ack_quorum:
        if len(stored) + len(asking) < meta.ack_quorum:
            if swapped:
                raise RecoveryFailed(
                    f"ledger {meta.ledger_id} entry {entry_id}: re-added on {len(stored)} "
                    f"replicas, {meta.ack_quorum} needed ({failed})"
                )
            try:
                meta = await _swap(client, meta, entry_id, list(failed))
            except NotEnoughNodes as error:
                raise RecoveryFailed(
                    f"ledger {meta.ledger_id} entry {entry_id}: re-added on {len(stored)} "
                    f"replicas, {meta.ack_quorum} needed ({failed}), and {error}"
                ) from error
            swapped = True
            ask([n for n in meta.write_set(entry_id) if n not in stored | set(asking.values())])
            continue
        done, _ = await asyncio.wait(asking, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            node = asking.pop(task)
            problem = task.exception()
            if problem is None:
                stored.add(node)
            else:
                failed[node] = getattr(problem, "code", repr(problem))
    for task, node in asking.items():
        task.add_done_callback(functools.partial(_late, meta.ledger_id, entry_id, node))
    return meta


def _late(ledger_id: int, entry_id: int, node: str, task: asyncio.Task[None]) -> None:
    """A re-add that went on after its entry had Qa copies: a failure leaves one copy short."""
    if not task.cancelled() and task.exception() is not None:
        RECOVERY_READDS_SHORT.inc()
        log.warning(
            "ledger %d entry %d: recovery re-add to %s failed after the ack quorum (%s); "
            "the copy is left to the auditor",
            ledger_id,
            entry_id,
            node,
            getattr(task.exception(), "code", repr(task.exception())),
        )


async def _swap(
    client: Client, meta: LedgerMetadata, entry_id: int, failed: list[str]
) -> LedgerMetadata:
    """``meta`` with a last segment from ``entry_id`` on whose ensemble ``failed`` are
    replaced (the last segment itself when it starts there)."""
    candidates = await client.registry.candidates()
    last = meta.last_segment
    swapped = list(last.ensemble)
    for node in failed:
        replacement = choose_replacement(
            candidates, swapped, node, client.rng, exclude=set(failed) | set(swapped)
        )
        swapped[swapped.index(node)] = replacement
    segment = Segment(entry_id, tuple(swapped))
    if last.first_entry_id == entry_id:
        return meta.evolve(segments=(*meta.segments[:-1], segment))
    return meta.evolve(segments=(*meta.segments, segment))
