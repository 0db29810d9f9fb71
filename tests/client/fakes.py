"""In-memory nodes that keep the bookie protocol's semantics (a fence is in place before the
answer that follows it; a recovery add passes a fence; "no such entry" only when the entry is not
stored), and a seeded network between each client and each node that delays, reorders, holds and
drops messages. The simulation runs the real writer and recovery over them."""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from node.client.bookies import LacAnswer, RangeAnswer, Replication, StartedAdd
from node.client.errors import ReplicaError
from node.client.metadata.memory import MemoryStore
from node.client.model import NodeInfo, node_key
from node.client.protocol import (
    ENTRY_CONFLICT,
    ENTRY_NOT_FOUND,
    INVALID_LAC,
    LEDGER_FENCED,
    LEDGER_NOT_FOUND,
)

UNREACHABLE = "unreachable"
IO_ERROR = "io_error"
# The chance that a message straggles on a delaying network, and for how many turns at most.
STRAGGLER = 0.05
STRAGGLER_TURNS = 300


@dataclass
class FakeLedger:
    replication: Replication
    entries: dict[int, bytes] = field(default_factory=dict)
    fenced: bool = False
    writer_lac: int = -1
    lac_length: int = 0


class FakeNode:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.ledgers: dict[int, FakeLedger] = {}
        self.down = False
        # Entry ids whose reads fail with io_error (BookKeeper #2908).
        self.read_errors: set[int] = set()
        self.busy = 0  # adds still to refuse with 503 backpressure

    def _fail(self, code: str, status: int) -> ReplicaError:
        return ReplicaError(self.node_id, code, status)

    def add(
        self,
        ledger_id: int,
        entries: Sequence[tuple[int, bytes]],
        lac: int,
        lac_length: int,
        replication: Replication,
        recovery: bool,
    ) -> None:
        if self.busy:
            self.busy -= 1
            raise self._fail("backpressure", 503)
        if self.busy:
            self.busy -= 1
            raise self._fail("backpressure", 503)
        if not recovery and lac > entries[-1][0]:  # as a node: a LAC past the entries sent
            raise self._fail(INVALID_LAC, 422)
        ledger = self.ledgers.setdefault(ledger_id, FakeLedger(replication))
        if ledger.fenced and not recovery:
            raise self._fail(LEDGER_FENCED, 409)
        for entry_id, payload in entries:
            held = ledger.entries.get(entry_id)
            if held is not None and held != payload:
                raise self._fail(ENTRY_CONFLICT, 409)
        for entry_id, payload in entries:
            ledger.entries[entry_id] = payload
        if lac > ledger.writer_lac:
            ledger.writer_lac, ledger.lac_length = lac, lac_length

    def read_lac(self, ledger_id: int, fence: bool, replication: Replication) -> LacAnswer:
        ledger = self.ledgers.get(ledger_id)
        if ledger is None:
            if not fence:
                raise self._fail(LEDGER_NOT_FOUND, 404)
            ledger = self.ledgers[ledger_id] = FakeLedger(replication)
        if fence:
            ledger.fenced = True
        last = max(ledger.entries, default=-1)
        return LacAnswer(ledger.writer_lac, ledger.lac_length, last, ledger.fenced)

    def read_entry(self, ledger_id: int, entry_id: int, fence: bool) -> bytes:
        ledger = self.ledgers.get(ledger_id)
        if fence:
            if ledger is None:
                ledger = self.ledgers[ledger_id] = FakeLedger((1, 1, 1))
            ledger.fenced = True
        if entry_id in self.read_errors:
            raise self._fail(IO_ERROR, 500)
        if ledger is None:
            raise self._fail(LEDGER_NOT_FOUND, 404)
        if entry_id not in ledger.entries:
            raise self._fail(ENTRY_NOT_FOUND, 404)
        return ledger.entries[entry_id]

    def read_range(self, ledger_id: int, first: int, last: int) -> RangeAnswer:
        """As a node's replica range read: the ids it holds in [first, last]; an id whose
        read fails cuts the reply there (read on from it: its error comes then)."""
        ledger = self.ledgers.get(ledger_id)
        if ledger is None:
            raise self._fail(LEDGER_NOT_FOUND, 404)
        held = sorted(e for e in ledger.entries if first <= e <= last)
        entries = []
        for entry_id in held:
            if entry_id in self.read_errors:
                if not entries:
                    raise self._fail(IO_ERROR, 500)
                return RangeAnswer(entries, entry_id)
            entries.append((entry_id, ledger.entries[entry_id]))
        return RangeAnswer(entries, None)


# (client, node, kind: add|lac|read, direction: request|reply) -> hold here?
Match = Callable[[str, str, str, str], bool]


@dataclass
class Gate:
    match: Match
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0

    def release(self) -> None:
        self.opened.set()


@dataclass
class Sent:
    client: str
    node: str
    kind: str
    detail: dict[str, object]


class Network:
    """Every message of every (client, node) pair goes through here. ``max_delay``: scheduler
    turns a message may wait (reorders them); ``drop``: chance that a request is lost before the
    node, or its reply after the node applied it. Seeded: the same seed, the same run."""

    def __init__(
        self,
        nodes: Sequence[FakeNode],
        seed: int = 0,
        max_delay: int = 0,
        drop: float = 0.0,
        slow_links: float = 0.0,
    ) -> None:
        """``slow_links``: the chance that a (client, node) link is slow (up to 20x
        ``max_delay`` turns a message), drawn once per link."""
        self.nodes = {n.node_id: n for n in nodes}
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.drop = drop
        self.slow_links = slow_links
        self._links: dict[tuple[str, str], int] = {}
        self.gates: list[Gate] = []
        self.log: list[Sent] = []

    def hold(self, match: Match) -> Gate:
        gate = Gate(match)
        self.gates.append(gate)
        return gate

    def _link_delay(self, client: str, node: str) -> int:
        link = (client, node)
        if link not in self._links:
            slow = self.rng.random() < self.slow_links
            self._links[link] = self.max_delay * 20 if slow else self.max_delay
        return self._links[link] if self.max_delay else 0

    async def _travel(self, client: str, node: str, kind: str, direction: str) -> None:
        await asyncio.sleep(0)  # a message takes a turn at least, as on any network
        turns = self.rng.randrange(self._link_delay(client, node) + 1)
        if self.max_delay and self.rng.random() < STRAGGLER:
            turns += self.rng.randrange(STRAGGLER_TURNS)  # overtaken by later messages
        for _ in range(turns):
            await asyncio.sleep(0)
        for gate in list(self.gates):
            if not gate.opened.is_set() and gate.match(client, node, kind, direction):
                gate.waiting += 1
                await gate.opened.wait()


class FakeTransport:
    """A client's Transport over the Network. ``started_adds``: ``start_add`` starts each
    add (the writer then deals with its outcome by callbacks, as over HTTP), else it declines
    and the writer's task awaits ``add``; either way the add travels the Network."""

    def __init__(self, network: Network, name: str, started_adds: bool = False) -> None:
        self.network = network
        self.name = name
        self.started_adds = started_adds

    async def _call(
        self,
        node_id: str,
        kind: str,
        detail: dict[str, object],
        apply: Callable[[FakeNode], object],
    ) -> object:
        net = self.network
        await net._travel(self.name, node_id, kind, "request")
        node = net.nodes.get(node_id)
        if node is None or node.down or net.rng.random() < net.drop:
            raise ReplicaError(node_id, UNREACHABLE)
        net.log.append(Sent(self.name, node_id, kind, detail))
        try:
            answer: object = apply(node)
        except ReplicaError as error:
            answer = error
        await net._travel(self.name, node_id, kind, "reply")
        if node.down or net.rng.random() < net.drop:
            raise ReplicaError(node_id, UNREACHABLE)
        if isinstance(answer, ReplicaError):
            raise answer
        return answer

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
        if not self.started_adds:
            return None
        outcome: StartedAdd = asyncio.get_running_loop().create_future()
        call = asyncio.ensure_future(
            self.add(
                node_id, ledger_id, entries, lac=lac, lac_length=lac_length, replication=replication
            )
        )
        call.add_done_callback(functools.partial(_settle_started, outcome))
        outcome.add_done_callback(lambda _: call.cancel())  # a cancelled outcome: stop waiting
        return outcome

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
        entries = list(entries)
        detail: dict[str, object] = {
            "ids": [e for e, _ in entries],
            "lac": lac,
            "recovery": recovery,
        }
        await self._call(
            node_id,
            "add",
            detail,
            lambda n: n.add(ledger_id, entries, lac, lac_length, replication, recovery),
        )

    async def read_lac(
        self, node_id: str, ledger_id: int, *, fence: bool, replication: Replication
    ) -> LacAnswer:
        answer = await self._call(
            node_id, "lac", {"fence": fence}, lambda n: n.read_lac(ledger_id, fence, replication)
        )
        assert isinstance(answer, LacAnswer)
        return answer

    async def read_entry(
        self, node_id: str, ledger_id: int, entry_id: int, *, fence: bool
    ) -> bytes:
        answer = await self._call(
            node_id,
            "read",
            {"entry_id": entry_id, "fence": fence},
            lambda n: n.read_entry(ledger_id, entry_id, fence),
        )
        assert isinstance(answer, bytes)
        return answer

    async def read_range(self, node_id: str, ledger_id: int, first: int, last: int) -> RangeAnswer:
        answer = await self._call(
            node_id,
            "read",
            {"entry_id": first, "last": last, "fence": False},
            lambda n: n.read_range(ledger_id, first, last),
        )
        assert isinstance(answer, RangeAnswer)
        return answer

    async def close(self) -> None:
        pass


async def register(store: MemoryStore, node_ids: Sequence[str], zones: Sequence[str] = ()) -> None:
    """Put ``nodes/<id>`` for each node, as a node's registration would."""
    lease = await store.grant_lease(3600)
    for index, node_id in enumerate(node_ids):
        zone = zones[index] if zones else ""
        info = NodeInfo(node_id, f"http://fake/{node_id}", zone)
        await store.put(node_key(node_id), info.encode(), lease=lease)


def _settle_started(outcome: StartedAdd, call: asyncio.Future[None]) -> None:
    if outcome.done():
        return
    if call.cancelled():
        outcome.cancel()
    elif (error := call.exception()) is not None:
        outcome.set_exception(error)
    else:
        outcome.set_result(None)
