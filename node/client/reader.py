"""Reading a replicated ledger (BookKeeper's ReadOnlyLedgerHandle, PendingReadOp and batch
reads): ranges from one replica (sticky) or each replica's stripe, and each entry no range
answer carried from any replica of its write set, failing over on any error; "no such entry"
from one replica is not final (another may hold it). An OPEN ledger is read up to its LAC
only, unless asked: the LAC comes from a non-fencing LAC read over a coverage of the last
segment's ensemble, so opening without recovery never disturbs the writer."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from node.client.bookies import LacAnswer, within
from node.client.errors import ClientError, ReadFailed, ReplicaError
from node.client.model import LedgerMetadata
from node.client.schedule import CoverageSet

if TYPE_CHECKING:
    from node.client.client import Client

ABSENT_LAC = LacAnswer(lac=-1, lac_length=0, last_entry_id=-1, fenced=False)
T = TypeVar("T")
MAX_ENTRY_ID = 2**63 - 1  # entry ids are u63: no segment ends before it


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
    """``nodes`` from a random one on (spreads reads), those in ``prefer`` first, then the
    client's home node."""
    start = client.rng.randrange(len(nodes))
    rotated = [*nodes[start:], *nodes[:start]]
    return sorted(rotated, key=lambda n: (n not in prefer, n != client.home_node))


async def first_answer(
    client: Client, nodes: Sequence[str], ask: Callable[[str], Awaitable[T]]
) -> tuple[str, T]:
    """The first node of ``nodes`` whose ``ask`` succeeds, with its answer: the next node is
    asked when one fails, and also when one has not answered in ``speculative_read_s`` (the
    first answer wins: a paused node costs that delay, not the read timeout). ReadFailed,
    naming every node's error, when none answers."""
    remaining = iter(nodes)
    asking: dict[asyncio.Task[T], str] = {}
    errors: list[str] = []

    def ask_next() -> None:
        node = next(remaining, None)
        if node is not None:
            asking[client._spawn(within(node, ask(node), client.read_timeout_s))] = node

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
                    return node, task.result()
                errors.append(f"{node}: {getattr(error, 'code', repr(error))}")
                ask_next()
    finally:
        for task in asking:
            task.cancel()
    raise ReadFailed(f"no replica answered ({errors})")


async def read_entry(
    client: Client, meta: LedgerMetadata, entry_id: int, prefer: Sequence[str] = ()
) -> bytes:
    """``entry_id`` from the first replica of its write set that returns it (``first_answer``:
    failing over on errors and on silence)."""

    def ask(node: str) -> Awaitable[bytes]:
        return client.transport.read_entry(node, meta.ledger_id, entry_id, fence=False)

    nodes = replica_order(client, meta.write_set(entry_id), prefer)
    try:
        return (await first_answer(client, nodes, ask))[1]
    except ReadFailed as error:
        raise ReadFailed(f"ledger {meta.ledger_id} entry {entry_id}: {error}") from None


class ReadHandle:
    """A ledger opened for reading: ``last_entry_id`` (the end of a CLOSED ledger, the LAC of an
    OPEN one when opened), ``read(first, last)``, ``read_lac()``.

    ``read`` goes by ranges (BookKeeper's batch reads, BP-62, with sticky reads): entries up
    to the LAC are immutable on every replica that holds them, so one replica can answer a
    whole range. With E = Qw every replica holds every entry: one range request to one
    replica, the same one while it answers (sticky), the next one when it fails. With E > Qw
    each replica holds its stripe: every replica of the segment is asked for the range and
    the stripes merge in order. An entry no range answer carried (a replica that missed an
    add, a reply cut by its byte budget and not read on, a failed replica) is read alone
    from its write set (``read_entry``): an entry is never taken as absent because one
    replica did not return it."""

    def __init__(self, client: Client, meta: LedgerMetadata, lac: int) -> None:
        self._client = client
        self.metadata = meta
        self.id = meta.ledger_id
        self._lac = lac
        self._sticky: str | None = None  # the replica whose last range answer was whole

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
        """(entry_id, payload) for first..last in order, by ranges of ``read_range_entries``
        (never across a segment's start), ``read_ahead_ranges`` of them in flight: the next
        range is on its way while the caller takes the current one."""
        if last < first and last == first - 1:
            return  # an empty ledger read 0..-1
        self._check_range(first, last, past_lac)
        ahead: deque[asyncio.Task[list[tuple[int, bytes]]]] = deque()
        next_id = first
        try:
            while next_id <= last or ahead:
                while next_id <= last and len(ahead) < self._client.read_ahead_ranges:
                    end = min(last, next_id + self._client.read_range_entries - 1)
                    end = min(end, self._segment_end(next_id))
                    ahead.append(self._client._spawn(self._read_range(next_id, end)))
                    next_id = end + 1
                for entry in await ahead.popleft():
                    yield entry
        finally:
            for task in ahead:
                task.cancel()

    def _segment_end(self, entry_id: int) -> int:
        """The last id of the segment holding ``entry_id`` (a range never spans two)."""
        later = [s.first_entry_id for s in self.metadata.segments if s.first_entry_id > entry_id]
        return min(later) - 1 if later else MAX_ENTRY_ID

    async def _read_range(self, first: int, last: int) -> list[tuple[int, bytes]]:
        meta = self.metadata
        ensemble = meta.segment_of(first).ensemble
        found: dict[int, bytes] = {}
        if meta.ensemble_size == meta.write_quorum:
            # No replica answering the range: each entry is asked for alone below.
            with contextlib.suppress(ReadFailed):
                self._sticky, found = await first_answer(
                    self._client,
                    self._replicas(ensemble),
                    lambda node: self._range_on(node, first, last),
                )
        else:
            timeout_s = self._client.read_timeout_s
            stripes = await asyncio.gather(
                *(within(node, self._range_on(node, first, last), timeout_s) for node in ensemble),
                return_exceptions=True,
            )
            for stripe in stripes:
                if isinstance(stripe, dict):
                    found.update(stripe)
                elif not isinstance(stripe, ReplicaError):
                    raise stripe
        entries = []
        for entry_id in range(first, last + 1):
            payload = found.get(entry_id)
            if payload is None:
                payload = await read_entry(self._client, meta, entry_id)
            entries.append((entry_id, payload))
        return entries

    def _replicas(self, ensemble: Sequence[str]) -> list[str]:
        """Who is asked for a range, in order: the sticky replica first while it is one of
        ``ensemble`` (else the client's home node when it is one: a local read; else a random
        one: spreads the readers of a ledger), then the ones after it in the ensemble."""
        if self._sticky in ensemble:
            start = ensemble.index(self._sticky)
        elif self._client.home_node in ensemble:
            start = ensemble.index(self._client.home_node)
        else:
            start = self._client.rng.randrange(len(ensemble))
        self._sticky = ensemble[start]  # ranges asked for meanwhile go to the same one
        return [*ensemble[start:], *ensemble[:start]]  # failing over in one order, too

    async def _range_on(self, node: str, first: int, last: int) -> dict[int, bytes]:
        """What ``node`` holds of [first, last], reading on where its byte budget cut a
        reply. ReplicaError when its first answer fails; a later failure keeps what came
        (the rest is read entry by entry). The caller times the whole."""
        found: dict[int, bytes] = {}
        start = first
        while start <= last:
            try:
                answer = await self._client.transport.read_range(node, self.id, start, last)
            except ReplicaError:
                if not found:
                    raise
                break
            found.update((e, p) for e, p in answer.entries if start <= e <= last)
            cut = answer.next_entry_id
            if cut is None or cut <= start:
                break
            start = cut
        return found
