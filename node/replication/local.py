"""The Transport of a node's own client (its replicated streams' writers and readers): a
replica add to this very node goes straight to its storage, as the replica route would take
it, instead of an HTTP request to itself (a request out, the same request in, two answers:
half the cost of an append on an owner in its ledger's ensemble); so does a range read of its
own replica (the client reads its home node first: a stream's catch-up on its owner reads
local files, as one node does). Everything else goes over ``remote``. A single fresh entry
(a stream's lone append) is queued for the journal in the writer's own step (``start_add``),
as the fast lane queues a remote node's: the local copy is one of the Qa an append waits for.

The storage's answer is the route's: ``add_replica`` returns once the entries are durable,
and a refusal is the ReplicaError of the same code the route's JSON error would carry. The
add runs to its end even when the writer stops waiting (its timeout, its client closing), as
it would on the other end of a request."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence

from node.client.bookies import (
    LacAnswer,
    MissingAnswer,
    RangeAnswer,
    Replication,
    StartedAdd,
    Transport,
)
from node.client.errors import ReplicaError
from node.client.stripes import Stripe
from node.metrics import Metrics
from node.storage.adds import PendingAdd, ReplicaAdd
from node.storage.errors import LedgerFenced, StorageError
from node.storage.ledgers import LedgerStorage


def _retrieved(add: asyncio.Future[None]) -> None:
    if not add.cancelled():
        add.exception()


class LocalReplica:
    """``remote`` for other nodes; this node's (``node_id``) replica adds to ``storage``."""

    def __init__(
        self,
        remote: Transport,
        node_id: str,
        storage: LedgerStorage,
        metrics: Metrics,
        reply_bytes: int,
    ) -> None:
        self._remote = remote
        self._node_id = node_id
        self._storage = storage
        self._metrics = metrics
        self._reply_bytes = reply_bytes  # a range answer's payload bytes, as the route's

    def start_add(
        self,
        node_id: str,
        ledger_id: int,
        entries: Sequence[tuple[int, bytes]],
        *,
        lac: int,
        lac_length: int,
        replication: Replication,
    ) -> StartedAdd | None:
        if node_id != self._node_id:
            return self._remote.start_add(
                node_id, ledger_id, entries, lac=lac, lac_length=lac_length, replication=replication
            )
        if len(entries) != 1:
            return None
        (entry_id, payload), started = entries[0], time.perf_counter()
        outcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            # The replica route's own first step (node.http.fastlane): the entry is queued for
            # the journal before this returns, as a remote node's is once its request lands.
            pending = self._storage.begin_replica_add(
                ledger_id, entry_id, payload, ReplicaAdd(replication, lac, lac_length)
            )
        except StorageError as error:
            self._refused(outcome, error)
            return outcome
        if pending is None:
            return None  # not a plain fresh entry of a ledger held here: ``add`` does it
        pending.future.add_done_callback(
            functools.partial(self._finished, pending, started, outcome)
        )
        return outcome

    def _finished(
        self,
        pending: PendingAdd,
        started: float,
        outcome: asyncio.Future[None],
        _done: object,
    ) -> None:
        # Finished even when the writer stopped waiting (cancelled ``outcome``): a refused
        # add gives back what it took, as the route's does.
        try:
            self._storage.finish_replica_add(pending)
        except StorageError as error:
            self._refused(outcome, error)
            return
        except asyncio.CancelledError:
            outcome.cancel()
            return
        except Exception as error:  # the writer's await gets it
            if not outcome.done():
                outcome.set_exception(error)
                outcome.exception()
            return
        self._metrics.add_latency_batch.observe(time.perf_counter() - started)
        if not outcome.done():
            outcome.set_result(None)

    def _refused(self, outcome: asyncio.Future[None], error: StorageError) -> None:
        """``outcome`` fails as ``add`` would have: the route's ReplicaError of the code."""
        if isinstance(error, LedgerFenced):
            self._metrics.replica_adds_refused_fenced.inc()
        if not outcome.done():
            outcome.set_exception(ReplicaError(self._node_id, error.code, 0, error.message))
            outcome.exception()  # its writer may have stopped waiting: no warning then

    async def add(
        self,
        node_id: str,
        ledger_id: int,
        entries: Sequence[tuple[int, bytes]],
        *,
        lac: int,
        lac_length: int,
        replication: Replication,
        recovery: bool = False,
    ) -> None:
        if node_id != self._node_id:
            await self._remote.add(
                node_id,
                ledger_id,
                entries,
                lac=lac,
                lac_length=lac_length,
                replication=replication,
                recovery=recovery,
            )
            return
        replica = ReplicaAdd(replication, lac, lac_length, recovery)
        add = asyncio.ensure_future(self._add(ledger_id, list(entries), replica))
        add.add_done_callback(_retrieved)  # also when nobody awaits it any more
        await asyncio.shield(add)

    async def _add(
        self, ledger_id: int, entries: list[tuple[int, bytes]], replica: ReplicaAdd
    ) -> None:
        started = time.perf_counter()
        try:
            await self._storage.add_replica(ledger_id, entries, replica)
        except StorageError as error:
            if isinstance(error, LedgerFenced):
                self._metrics.replica_adds_refused_fenced.inc()
            raise ReplicaError(self._node_id, error.code, 0, error.message) from None
        self._metrics.add_latency_batch.observe(time.perf_counter() - started)

    async def read_lac(
        self, node_id: str, ledger_id: int, *, fence: bool, replication: Replication
    ) -> LacAnswer:
        return await self._remote.read_lac(node_id, ledger_id, fence=fence, replication=replication)

    async def read_entry(
        self, node_id: str, ledger_id: int, entry_id: int, *, fence: bool
    ) -> bytes:
        return await self._remote.read_entry(node_id, ledger_id, entry_id, fence=fence)

    async def read_range(self, node_id: str, ledger_id: int, first: int, last: int) -> RangeAnswer:
        """As the range route answers: cut by the reply's byte budget (``next_entry_id``),
        and by an error after the first entry (reading on from there meets it)."""
        if node_id != self._node_id:
            return await self._remote.read_range(node_id, ledger_id, first, last)
        found: list[tuple[int, bytes]] = []
        size = 0
        try:
            async for entry_id, payload in self._storage.read_range(ledger_id, first, last):
                size += len(payload)
                if found and size > self._reply_bytes:
                    return RangeAnswer(found, entry_id)
                found.append((entry_id, payload))
        except StorageError as error:
            if not found:
                raise ReplicaError(self._node_id, error.code, 0, error.message) from None
            return RangeAnswer(found, found[-1][0] + 1)
        return RangeAnswer(found, None)

    async def missing(
        self, node_id: str, ledger_id: int, first: int, last: int, stripe: Stripe
    ) -> MissingAnswer:
        return await self._remote.missing(node_id, ledger_id, first, last, stripe)

    async def close(self) -> None:
        await self._remote.close()
