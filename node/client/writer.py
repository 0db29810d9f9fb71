"""The writer of one replicated ledger (BookKeeper's LedgerHandle and PendingAddOp).

Entry e goes to the Qw nodes of its write set, carrying the writer's LAC, in one request per
node with every add made in the same turn of the event loop (an idle writer's first add goes
at once, the rest of its turn's adds at the turn's end); while ``adds_in_flight_per_node``
requests to a node are out, the adds made meanwhile wait for one of them to answer and go to
it together (Nagle's rule: under concurrent adds, fewer and larger requests, each costing a
node one parse, one journal write and one answer; a lone add never waits, and with Qa < Qw
the other nodes of the write set acknowledge meanwhile). It is acknowledged once Qa of them
stored it durably, and acknowledgements (so the LAC) advance strictly in entry order. A node that
fails (an error, no answer in time) is replaced by an ensemble change: a compare-and-set of the
metadata that starts a new segment at LAC+1 with the replacement, after which every
unacknowledged add is resent to it. Acknowledgements stop while a change is under way, so no
entry is confirmed under an ensemble the metadata does not name. A failure after an entry was
acknowledged still changes the ensemble (BookKeeper #1390).

A writer that finds the ledger fenced (a node says ``ledger_fenced``, or the metadata is
IN_RECOVERY or CLOSED) cannot know whether its unacknowledged adds will be kept by the recovery:
each of them raises AddOutcomeUnknown, never a plain failure."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING

from node.client.bookies import StartedAdd, timed_out, within
from node.client.errors import (
    AddFailed,
    AddOutcomeUnknown,
    ClientError,
    LedgerClosedElsewhere,
    LedgerClosedError,
    LedgerFencedError,
    MetadataError,
    NotEnoughNodes,
    ReplicaError,
)
from node.client.metadata.loop import update
from node.client.metadata.store import Versioned
from node.client.metrics import (
    ADDS_UNKNOWN,
    ENSEMBLE_CHANGES,
    REPLICA_ADD_SECONDS,
    UNDER_REPLICATED_ADDS,
)
from node.client.model import LedgerMetadata, LedgerState, Segment, decode, encode, ledger_key
from node.client.placement import choose_replacement

if TYPE_CHECKING:
    from node.client.session import Session as Client  # what it needs of client.Client

log = logging.getLogger(__name__)

# Why a pending add's outcome became unknown (the label of storage_client_adds_unknown_total).
FENCED = "fenced"
IN_RECOVERY = "in_recovery"
CLOSED = "closed"
NO_REPLACEMENT = "no_replacement"
ENSEMBLE_CHANGES_EXHAUSTED = "ensemble_changes"
METADATA = "metadata"
UNAUTHORIZED = "unauthorized"
CLIENT_CLOSED = "client_closed"

# A node's answers that mean the client is misconfigured (no or another admin token): replacing
# the node would only meet the same answer on the next one.
REFUSED_CODES = frozenset({"unauthorized", "forbidden"})

# A node's answers that mean "busy, ask again" rather than "failed": the writer retries the same
# node after this pause while the add's time lasts, instead of replacing it.
BACKPRESSURE_CODES = frozenset({"backpressure", "overloaded", "too_many_connections"})
BACKPRESSURE_PAUSE_S = 0.05


class _PendingAdd:
    """One entry in flight. Only the last entry of an add or a batch has a future (one per
    call, not per entry); ``batch_first`` is its call's first id; ``offset`` the ledger's
    payload bytes before it."""

    __slots__ = (
        "acks",
        "batch_first",
        "done",
        "entry_id",
        "future",
        "offset",
        "payload",
        "write_set",
    )

    def __init__(self, entry_id: int, payload: bytes, offset: int, write_set: list[str]) -> None:
        self.entry_id = entry_id
        self.payload = payload
        self.offset = offset
        self.write_set = write_set
        self.future: asyncio.Future[int] | None = None
        self.batch_first = entry_id
        self.acks: set[str] = set()
        self.done = False


class LedgerHandle:
    """The writer of ledger ``id``: ``add``, ``add_batch``, ``close``. One per ledger, in the
    process that created it."""

    def __init__(self, client: Client, versioned: Versioned) -> None:
        self._client = client
        self._versioned = versioned
        self._meta = decode(versioned.value)
        self.id = self._meta.ledger_id
        self.lac = -1  # last add confirmed: every entry up to it has Qa durable copies
        self._lac_length = 0  # payload bytes up to and including the LAC
        self._next_id = 0
        self._next_offset = 0  # payload bytes of every entry submitted
        self._pending: deque[_PendingAdd] = deque()
        # Adds submitted in this turn of the event loop, by node: sent together at its end, so
        # many single adds in flight cost one request per node rather than one per entry.
        self._outbox: dict[str, list[_PendingAdd]] = {}
        self._flush_due = False  # the end-of-turn flush is scheduled
        # Per node: its requests out, and the adds waiting for one of them to answer.
        self._out: dict[str, int] = {}
        # Nodes an idle writer sent its first add to in this turn: the rest of the turn's
        # adds still go to them at its end, one request over adds_in_flight_per_node.
        self._eager: set[str] = set()
        self._held: dict[str, list[_PendingAdd]] = {}
        self._failed: set[str] = set()  # nodes of the last ensemble to replace
        self._changing: asyncio.Task[None] | None = None
        self._changes = 0
        self._error: ClientError | None = None  # set once the handle is unusable
        self._closing = False
        self._closed: LedgerMetadata | None = None
        self._drained = asyncio.Event()
        self._drained.set()
        client._handles.add(self)  # settled by the client's close

    @property
    def metadata(self) -> LedgerMetadata:
        return self._meta

    @property
    def next_entry_id(self) -> int:
        """The id the next add will get (assigned when ``add`` or ``add_batch`` is called)."""
        return self._next_id

    @property
    def length(self) -> int:
        """Payload bytes of the entries up to the LAC."""
        return self._lac_length

    @property
    def _replication(self) -> tuple[int, int, int]:
        m = self._meta
        return m.ensemble_size, m.write_quorum, m.ack_quorum

    async def add(self, payload: bytes) -> int:
        """The entry id of ``payload`` once Qa nodes hold it durably and every earlier entry is
        acknowledged. AddOutcomeUnknown when the writer lost the ledger with it unacknowledged
        (it may be in the ledger); AddFailed when nothing was sent (a closed or unusable
        handle, an entry over ``max_entry_size``)."""
        _, last = self.submit([payload])
        return await last

    async def add_batch(self, payloads: Sequence[bytes]) -> tuple[int, int]:
        """(first, last) ids of ``payloads``, consecutive, once all are acknowledged. One request
        per node carries all the entries that node holds. On failure the first unacknowledged
        entry's AddOutcomeUnknown is raised: acknowledgements go in id order, so the batch's
        entries before its ``entry_id`` are acknowledged and the rest are unknown."""
        if not payloads:
            raise ValueError("add_batch needs at least one payload")
        first, last = self.submit(payloads)
        return first, await last

    def _check_sendable(self, payloads: Sequence[bytes]) -> None:
        """AddFailed (nothing sent, no id taken) unless these adds can go out."""
        if self._error is not None:
            raise AddFailed(f"ledger {self.id}: the handle is unusable") from self._error
        if self._closing:
            raise AddFailed(f"ledger {self.id}: the handle is closed") from LedgerClosedError()
        limit = self._client.max_entry_size
        if any(len(p) > limit for p in payloads):
            raise AddFailed(f"ledger {self.id}: an entry is larger than {limit} bytes")

    def submit(self, payloads: Sequence[bytes]) -> tuple[int, asyncio.Future[int]]:
        """``add_batch`` without waiting: ``payloads`` take the next ids and are on their
        way (written before this returns when the writer was idle) when it returns (first
        id, the future of the last one: its id, or add_batch's errors). AddFailed at once
        when nothing can be sent."""
        self._check_sendable(payloads)
        loop = asyncio.get_running_loop()
        first = self._next_id
        pendings = []
        for payload in payloads:
            entry_id, data = self._next_id, bytes(payload)
            pendings.append(
                _PendingAdd(entry_id, data, self._next_offset, self._meta.write_set(entry_id))
            )
            self._next_id += 1
            self._next_offset += len(data)
        last = pendings[-1]
        future: asyncio.Future[int] = loop.create_future()
        last.future, last.batch_first = future, first
        self._pending.extend(pendings)
        self._drained.clear()
        # An idle writer sends at once, in its caller's step: a lone add (a tailing stream's)
        # goes out without waiting for the loop, and adds made later in the same turn still
        # go together at its end (_eager).
        idle = not self._out
        if not self._flush_due:
            self._flush_due = True
            loop.call_soon(self._end_turn)
        for pending in pendings:
            for node in pending.write_set:
                self._outbox.setdefault(node, []).append(pending)
        if idle:
            self._eager.update(self._outbox)
            self._flush()
        return first, future

    def _end_turn(self) -> None:
        self._flush_due = False
        self._flush()
        self._eager.clear()

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        limit = self._client.adds_in_flight_per_node
        # The home node last: its journal write is the shortest way to a copy, and its
        # thread, once woken, holds the GIL and a core while the requests to the other
        # nodes, the longer ways, would wait (they went out 0.3 ms later when it came first).
        home = self._client.home_node
        for node, group in sorted(outbox.items(), key=lambda item: item[0] == home):
            if self._out.get(node, 0) >= limit + (node in self._eager):
                self._held.setdefault(node, []).extend(group)
            else:
                self._send_all(node, group)

    def _answered(self, node: str) -> None:
        """A request to ``node`` is over: the adds held for it go now, in one request (those
        an ensemble change moved to another node meanwhile went there)."""
        out = self._out[node] - 1
        if out:
            self._out[node] = out
        else:
            del self._out[node]
        held = self._held.pop(node, None)
        if held is None or self._error is not None:
            return
        group = [pending for pending in held if node in pending.write_set]
        if group:
            self._send_all(node, group)

    def _send_all(self, node: str, group: list[_PendingAdd]) -> None:
        """One request per ``max_request_bytes`` or ``max_request_entries`` of ``group`` (most
        turns of the loop: one)."""
        limit, count = self._client.max_request_bytes, self._client.max_request_entries
        start, size = 0, 0
        for index, pending in enumerate(group):
            if size and (size + len(pending.payload) > limit or index - start >= count):
                self._spawn_send(node, group[start:index])
                start, size = index, 0
            size += len(pending.payload)
        self._spawn_send(node, group[start:])

    def _spawn_send(self, node: str, group: list[_PendingAdd]) -> None:
        """The request written now when the transport can (``start_add``: its answer is
        dealt with by callbacks, with no task unless it fails), else by a task that awaits
        ``add``."""
        self._out[node] = self._out.get(node, 0) + 1
        started = time.monotonic()
        lac, lac_length = self._lac_below(group)
        sent = self._client.transport.start_add(
            node,
            self.id,
            [(p.entry_id, p.payload) for p in group],
            lac=lac,
            lac_length=lac_length,
            replication=self._replication,
        )
        if sent is None:
            self._client._spawn(self._send(node, group, started, None))
            return
        # Cancelling the outcome makes the transport stop waiting (as ``within`` does).
        timer = asyncio.get_running_loop().call_later(self._client.add_timeout_s, sent.cancel)
        sent.add_done_callback(functools.partial(self._started_over, node, group, started, timer))

    def _started_over(
        self,
        node: str,
        group: list[_PendingAdd],
        started: float,
        timer: asyncio.TimerHandle,
        sent: StartedAdd,
    ) -> None:
        """A started add's outcome, on its own callback: a copy acknowledged before any
        task wakes (a task per copy woke ahead of the acknowledgement, and cost its own CPU);
        a refusal goes to a task, which asks again after a node's push-back."""
        timer.cancel()
        if not sent.cancelled() and sent.exception() is not None:
            self._client._spawn(self._send(node, group, started, sent))
            return
        REPLICA_ADD_SECONDS.labels(node).observe(time.monotonic() - started)
        if sent.cancelled():
            self._send_failed(node, group, timed_out(node, self._client.add_timeout_s))
        else:
            self._stored(node, group)
        self._answered(node)

    async def _send(
        self, node: str, group: list[_PendingAdd], started: float, sent: StartedAdd | None
    ) -> None:
        try:
            await self._send_now(node, group, started, sent)
        finally:
            self._answered(node)

    async def _send_now(
        self, node: str, group: list[_PendingAdd], started: float, sent: StartedAdd | None
    ) -> None:
        try:
            await self._add_on(node, group, started, sent)
        except Exception as error:
            self._send_failed(node, group, error)
            return
        finally:
            REPLICA_ADD_SECONDS.labels(node).observe(time.monotonic() - started)
        self._stored(node, group)

    def _send_failed(self, node: str, group: list[_PendingAdd], error: Exception) -> None:
        """Any failure is the node's: the add must not hang."""
        if isinstance(error, ReplicaError) and error.fenced:
            self._give_up(FENCED, LedgerFencedError(f"ledger {self.id}: fenced by {node}"))
            return
        if isinstance(error, ReplicaError) and error.code in REFUSED_CODES:
            message = f"node {node} refused the add ({error.code}): pass its admin token"
            self._give_up(UNAUTHORIZED, ClientError(message))
            return
        if not isinstance(error, ReplicaError):
            log.error("ledger %d: replica add to %s failed", self.id, node, exc_info=error)
        if any(p.done for p in group):
            UNDER_REPLICATED_ADDS.inc()
        self._node_failed(node)

    def _stored(self, node: str, group: list[_PendingAdd]) -> None:
        """``node`` holds ``group``."""
        for pending in group:
            if not pending.done and node in pending.write_set:
                pending.acks.add(node)
        self._complete()

    def _lac_below(self, group: list[_PendingAdd]) -> tuple[int, int]:
        """The LAC (and its length) an add of ``group`` carries: below the request's first
        entry, as BookKeeper's is. An add held behind this node's previous request (or
        retried) may go out after the other replicas acknowledged its entries, and a node
        refuses a LAC past the entries it holds (invalid_lac). Readers and recovery then see
        a LAC that trails the writer's."""
        lac, lac_length = self.lac, self._lac_length
        if lac >= group[0].entry_id:
            lac, lac_length = group[0].entry_id - 1, group[0].offset
        return lac, lac_length

    async def _add_on(
        self, node: str, group: list[_PendingAdd], started: float, sent: StartedAdd | None
    ) -> None:
        """One replica add (``sent``: already written); a node that pushes back (its write
        cache full, too many requests) is asked again after a pause, until the add's time is
        up."""
        deadline = started + self._client.add_timeout_s
        while True:
            answer: Awaitable[None]
            if sent is None:
                lac, lac_length = self._lac_below(group)
                answer = self._client.transport.add(
                    node,
                    self.id,
                    [(p.entry_id, p.payload) for p in group],
                    lac=lac,
                    lac_length=lac_length,
                    replication=self._replication,
                )
            else:
                answer, sent = sent, None  # failed already: a push-back is asked again
            try:
                await within(node, answer, max(deadline - time.monotonic(), 0.001))
                return
            except ReplicaError as error:
                pause = BACKPRESSURE_PAUSE_S
                if error.code not in BACKPRESSURE_CODES or time.monotonic() + pause >= deadline:
                    raise
                await asyncio.sleep(pause)

    def _complete(self) -> None:
        """Acknowledge the head of the queue while it has Qa acks: strictly in entry order."""
        if self._changing is not None or self._error is not None:
            return
        qa = self._meta.ack_quorum
        while self._pending and len(self._pending[0].acks) >= qa:
            pending = self._pending.popleft()
            pending.done = True
            self.lac = pending.entry_id
            self._lac_length += len(pending.payload)
            if pending.future is not None and not pending.future.done():
                pending.future.set_result(pending.entry_id)
        if not self._pending:
            self._drained.set()

    def _give_up(self, reason: str, error: ClientError) -> None:
        """The handle is unusable: every pending add's outcome is unknown."""
        if self._error is None:
            self._error = error
        first_unknown = self._pending[0].entry_id if self._pending else 0
        if self._pending:
            ADDS_UNKNOWN.labels(reason).inc(len(self._pending))
        while self._pending:
            pending = self._pending.popleft()
            future = pending.future
            if future is not None and not future.done():
                # The call's entries before the queue's head were acknowledged.
                entry_id = max(pending.batch_first, first_unknown)
                future.set_exception(AddOutcomeUnknown(entry_id, reason))
                future.exception()  # the caller may not await it: no warning then
        self._drained.set()

    def _client_closed(self) -> None:
        """The client closes (its requests are about to be cancelled): every pending add's
        outcome is unknown, and the handle is unusable."""
        if self._closed is None:
            self._give_up(CLIENT_CLOSED, LedgerClosedError(f"ledger {self.id}: the client closed"))

    def _node_failed(self, node: str) -> None:
        if self._error is not None or self._closed is not None:
            return
        if self._closing and not self._pending:
            return  # every add is settled and the close is under way: no entry needs the node
        if node not in self._meta.last_segment.ensemble:
            return  # replaced already: a late answer of an older request
        self._failed.add(node)
        if self._changing is None:
            self._changing = self._client._spawn(self._change_ensemble())

    async def _change_ensemble(self) -> None:
        try:
            while self._error is None:
                ensemble = self._meta.last_segment.ensemble
                failed = [n for n in ensemble if n in self._failed]
                if not failed:
                    break
                if self._changes >= self._client.max_ensemble_changes:
                    self._give_up(
                        ENSEMBLE_CHANGES_EXHAUSTED,
                        LedgerClosedError(
                            f"ledger {self.id}: {self._changes} ensemble changes, the limit"
                        ),
                    )
                    break
                await self._replace(ensemble, failed)
        except Exception as error:  # the task has no awaiter: the handle reports it instead
            self._give_up(METADATA, LedgerClosedError(f"ledger {self.id}: {error!r}"))
        finally:
            self._changing = None
            self._complete()

    async def _replace(self, ensemble: tuple[str, ...], failed: list[str]) -> None:
        try:
            candidates = await self._client.registry.candidates()
            replacements: dict[str, str] = {}
            for node in failed:
                taken = set(ensemble) | set(replacements.values())
                replacements[node] = choose_replacement(
                    candidates, ensemble, node, self._client.rng, exclude=taken | set(failed)
                )
        except NotEnoughNodes as error:
            self._give_up(NO_REPLACEMENT, LedgerClosedError(f"ledger {self.id}: {error}"))
            return
        except MetadataError as error:
            self._give_up(METADATA, LedgerClosedError(f"ledger {self.id}: {error}"))
            return
        lac = self.lac  # cannot move: acknowledgements wait for the change

        def needs(raw: bytes) -> bool:
            meta = decode(raw)
            return meta.state is LedgerState.OPEN and any(
                n in meta.last_segment.ensemble for n in failed
            )

        def transform(raw: bytes) -> bytes:
            meta = decode(raw)
            last = meta.last_segment
            swapped = tuple(replacements.get(n, n) for n in last.ensemble)
            if last.first_entry_id == lac + 1:  # nothing confirmed under it: replace it
                segments = (*meta.segments[:-1], Segment(last.first_entry_id, swapped))
            else:
                segments = (*meta.segments, Segment(lac + 1, swapped))
            return encode(meta.evolve(segments=segments))

        try:
            versioned = await update(
                self._client.store, ledger_key(self.id), self._versioned, needs, transform
            )
        except MetadataError as error:
            self._give_up(METADATA, LedgerClosedError(f"ledger {self.id}: {error}"))
            return
        meta = decode(versioned.value)
        if meta.state is not LedgerState.OPEN:
            reason = IN_RECOVERY if meta.state is LedgerState.IN_RECOVERY else CLOSED
            self._give_up(
                reason, LedgerFencedError(f"ledger {self.id}: {meta.state.value} in the metadata")
            )
            return
        self._meta, self._versioned = meta, versioned
        self._failed -= set(failed)  # replaced: a later choice may take them again
        self._changes += 1
        ENSEMBLE_CHANGES.inc()
        resend: dict[str, list[_PendingAdd]] = {}
        for pending in self._pending:
            now = meta.write_set(pending.entry_id)
            pending.acks &= set(now)
            for node in set(now) - set(pending.write_set):
                resend.setdefault(node, []).append(pending)
            pending.write_set = now
        for node, group in resend.items():
            self._send_all(node, group)

    async def close(self) -> LedgerMetadata:
        """Wait for the pending adds, then close the ledger at the LAC in the metadata (a CAS).
        Idempotent. LedgerFencedError when a recovery took the ledger; LedgerClosedElsewhere
        when someone closed it at another end (lastEntryId or length); LedgerClosedError when
        the client closed first (the ledger stays OPEN: a recovery ends it)."""
        if self._closed is not None:
            return self._closed
        self._closing = True
        while self._pending or self._changing is not None:
            await self._drained.wait()
            if self._changing is not None:
                # Not shield: a change cancelled by the client's close must not raise here.
                await asyncio.wait({self._changing})
        if isinstance(self._error, LedgerFencedError):
            raise LedgerFencedError(f"ledger {self.id}: fenced, not closed by this writer")
        if self._client.closed:
            raise LedgerClosedError(f"ledger {self.id}: the client is closed, the ledger not")
        lac, length = self.lac, self._lac_length

        def needs(raw: bytes) -> bool:
            meta = decode(raw)
            if meta.state is LedgerState.CLOSED:
                if (meta.last_entry_id, meta.length) == (lac, length):
                    return False
                raise LedgerClosedElsewhere(
                    f"ledger {self.id}: closed at {meta.last_entry_id} ({meta.length} bytes), "
                    f"this writer's end is {lac} ({length} bytes)"
                )
            if meta.state is LedgerState.IN_RECOVERY:
                raise LedgerFencedError(f"ledger {self.id}: in recovery, not closed by this writer")
            return True

        def transform(raw: bytes) -> bytes:
            meta = decode(raw)
            closed = meta.evolve(
                state=LedgerState.CLOSED,
                last_entry_id=lac,
                length=length,
                closed_ms=int(time.time() * 1000),
            )
            return encode(closed)

        versioned = await update(
            self._client.store, ledger_key(self.id), self._versioned, needs, transform
        )
        self._versioned = versioned
        self._closed = self._meta = decode(versioned.value)
        return self._closed
