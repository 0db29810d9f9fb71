"""Reading a replicated ledger (BookKeeper's ReadOnlyLedgerHandle, PendingReadOp): each entry
from any replica of its write set, failing over on any error; "no such entry" from one replica is
not final (another may hold it). An OPEN ledger is read up to its LAC only, unless asked: the LAC
comes from a non-fencing LAC read over a coverage of the last segment's ensemble, so opening
without recovery never disturbs the writer."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from node.client.bookies import LacAnswer, within
from node.client.errors import ClientError, ReadFailed, ReplicaError
from node.client.model import LedgerMetadata
from node.client.schedule import CoverageSet

if TYPE_CHECKING:
    from node.client.client import Client

ABSENT_LAC = LacAnswer(lac=-1, lac_length=0, last_entry_id=-1, fenced=False)


async def read_lac_coverage(
    client: Client,
    meta: LedgerMetadata,
    *,
    fence: bool,
    timeout_s: float,
    failure: type[ClientError],
) -> dict[str, LacAnswer]:
    """LAC answers of the last segment's ensemble once they cover it (every write quorum has
    fewer than Qa members unknown). A replica without the ledger counts as known, at LAC -1.
    ``failure`` (with every answer in its message) when the answers cannot cover it in
    ``timeout_s``. Requests still out go on (a fence must land everywhere it can)."""
    ensemble = meta.last_segment.ensemble
    replication = (meta.ensemble_size, meta.write_quorum, meta.ack_quorum)
    coverage = CoverageSet(meta.ensemble_size, meta.write_quorum, meta.ack_quorum)
    answers: dict[str, LacAnswer] = {}
    errors: dict[str, str] = {}

    async def ask(index: int, node: str) -> None:
        try:
            answers[node] = await within(
                node,
                client.transport.read_lac(
                    node, meta.ledger_id, fence=fence, replication=replication
                ),
                timeout_s,
            )
        except ReplicaError as error:
            if not error.absent:
                errors[node] = error.code
                return
            answers[node] = ABSENT_LAC
        coverage.add(index)

    tasks = {client._spawn(ask(i, node)) for i, node in enumerate(ensemble)}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not coverage.covered():
        if not tasks or loop.time() >= deadline:
            raise failure(
                f"ledger {meta.ledger_id}: LAC answers do not cover ensemble {list(ensemble)} "
                f"(answers {dict((n, a.lac) for n, a in answers.items())}, errors {errors})"
            )
        _, tasks = await asyncio.wait(
            tasks, timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED
        )
    return dict(answers)


def lac_of(meta: LedgerMetadata, answers: dict[str, LacAnswer]) -> int:
    """An OPEN ledger's LAC: the highest writer LAC a replica saw, and at least the entry before
    the last segment (an ensemble change starts a segment only after the writer's LAC)."""
    return max([meta.last_segment.first_entry_id - 1, *(a.lac for a in answers.values())])


def replica_order(client: Client, nodes: Sequence[str], prefer: Sequence[str] = ()) -> list[str]:
    """``nodes`` from a random one on (spreads reads), those in ``prefer`` first."""
    start = client.rng.randrange(len(nodes))
    rotated = [*nodes[start:], *nodes[:start]]
    return sorted(rotated, key=lambda n: n not in prefer)


async def read_entry(
    client: Client, meta: LedgerMetadata, entry_id: int, prefer: Sequence[str] = ()
) -> bytes:
    """``entry_id`` from the first replica of its write set that returns it: the next replica is
    asked when one fails, and also when one has not answered in ``speculative_read_s`` (the
    first answer wins, a paused node costs that delay, not the read timeout)."""
    nodes = iter(replica_order(client, meta.write_set(entry_id), prefer))
    asking: dict[asyncio.Task[bytes], str] = {}
    errors: list[str] = []

    def ask_next() -> None:
        node = next(nodes, None)
        if node is not None:
            call = client.transport.read_entry(node, meta.ledger_id, entry_id, fence=False)
            asking[client._spawn(within(node, call, client.read_timeout_s))] = node

    ask_next()
    try:
        while asking:
            done, _ = await asyncio.wait(
                asking, timeout=client.speculative_read_s, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                ask_next()
                continue
            for task in done:
                node = asking.pop(task)
                error = task.exception()
                if error is None:
                    return task.result()
                errors.append(f"{node}: {getattr(error, 'code', repr(error))}")
                ask_next()
    finally:
        for task in asking:
            task.cancel()
    raise ReadFailed(f"ledger {meta.ledger_id} entry {entry_id}: no replica returned it ({errors})")


class ReadHandle:
    """A ledger opened for reading: ``last_entry_id`` (the end of a CLOSED ledger, the LAC of an
    OPEN one when opened), ``read(first, last)``, ``read_lac()``."""

    def __init__(self, client: Client, meta: LedgerMetadata, lac: int) -> None:
        self._client = client
        self.metadata = meta
        self.id = meta.ledger_id
        self._lac = lac

    @property
    def closed(self) -> bool:
        return self.metadata.closed

    @property
    def last_entry_id(self) -> int:
        return self.metadata.last_entry_id if self.metadata.closed else self._lac

    async def read_lac(self) -> int:
        """Ask the replicas again (an OPEN ledger's LAC grows while its writer writes)."""
        if not self.metadata.closed:
            answers = await read_lac_coverage(
                self._client,
                self.metadata,
                fence=False,
                timeout_s=self._client.read_timeout_s,
                failure=ReadFailed,
            )
            self._lac = max(self._lac, lac_of(self.metadata, answers))
        return self.last_entry_id

    async def read_entry(self, entry_id: int, *, past_lac: bool = False) -> bytes:
        self._check_range(entry_id, entry_id, past_lac)
        return await read_entry(self._client, self.metadata, entry_id)

    def _check_range(self, first: int, last: int, past_lac: bool) -> None:
        if first < 0 or last < first:
            raise ValueError(f"ledger {self.id}: bad range {first}..{last}")
        if self.metadata.closed and last > self.metadata.last_entry_id:
            raise ValueError(
                f"ledger {self.id}: closed at {self.metadata.last_entry_id}, no entry {last}"
            )
        if not past_lac and last > self.last_entry_id:
            raise ValueError(
                f"ledger {self.id}: entry {last} is past the LAC {self.last_entry_id} "
                "(read_lac() again, or past_lac=True)"
            )

    async def read(
        self, first: int, last: int, *, past_lac: bool = False
    ) -> AsyncIterator[tuple[int, bytes]]:
        """(entry_id, payload) for first..last in order; ``read_window`` entries in flight."""
        if last < first and last == first - 1:
            return  # an empty ledger read 0..-1
        self._check_range(first, last, past_lac)
        window: deque[asyncio.Task[bytes]] = deque()
        next_id = first
        try:
            while next_id <= last or window:
                while next_id <= last and len(window) < self._client.read_window:
                    window.append(
                        asyncio.ensure_future(read_entry(self._client, self.metadata, next_id))
                    )
                    next_id += 1
                entry_id = next_id - len(window)
                yield entry_id, await window.popleft()
        finally:
            for task in window:
                task.cancel()
