"""The client's metadata changes through the CAS loop when the store loses answers or another
party changes the ledger first: an applied change is found done (never applied twice), a
recovery that got in first turns the writer's pending adds into AddOutcomeUnknown."""

from __future__ import annotations

import asyncio
import random

import pytest

from node.client import AddOutcomeUnknown, Client, LedgerFencedError
from node.client.errors import OutcomeUnknown
from node.client.metadata.memory import MemoryStore
from node.client.metadata.store import Versioned
from node.client.model import LedgerState, decode, encode, ledger_key
from tests.client.fakes import FakeNode, FakeTransport, Network, register


class LosesAnswers(MemoryStore):
    """Loses the answer of the next ``lose`` changes after applying them."""

    def __init__(self) -> None:
        super().__init__()
        self.lose = 0
        self.changes = 0

    def _lost(self) -> None:
        self.changes += 1
        if self.lose:
            self.lose -= 1
            raise OutcomeUnknown("the answer was lost")

    async def cas(self, key: str, value: bytes, revision: int) -> Versioned:
        done = await super().cas(key, value, revision)
        self._lost()
        return done

    async def create(self, key: str, value: bytes, *, lease: int | None = None) -> Versioned:
        done = await super().create(key, value, lease=lease)
        self._lost()
        return done


async def setup(nodes: int = 4) -> tuple[LosesAnswers, Network, Client]:
    store = LosesAnswers()
    ids = [f"n{i}" for i in range(nodes)]
    await register(store, ids)
    net = Network([FakeNode(n) for n in ids])
    return store, net, Client(store, transport=FakeTransport(net, "w"), rng=random.Random(3))


async def test_a_create_whose_answer_is_lost_is_found_by_its_creator() -> None:
    store, _, client = await setup()
    store.lose = 1
    ledger = await client.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
    assert (await client.ledger_metadata(ledger.id))["creator"] == ledger.metadata.creator
    assert len(await client.ledgers()) == 1
    await client.close()


async def test_an_ensemble_change_and_a_close_whose_answers_are_lost_are_done_once() -> None:
    store, net, client = await setup()
    ledger = await client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3)
    await ledger.add(b"a")
    net.nodes[ledger.metadata.last_segment.ensemble[2]].down = True
    store.lose = 1
    before = store.changes
    assert await ledger.add(b"b") == 1
    assert store.changes == before + 1  # one CAS applied, its lost answer re-read, not redone
    assert [s.first_entry_id for s in ledger.metadata.segments] == [0, 1]
    store.lose = 1
    closed = await ledger.close()
    assert closed.state is LedgerState.CLOSED and closed.last_entry_id == 1
    assert store.changes == before + 2
    meta = await client.ledger_metadata(ledger.id)
    assert meta["lastEntryId"] == 1 and len(meta["segments"]) == 2
    await client.close()


async def test_an_ensemble_change_that_meets_a_recovery_makes_pending_adds_unknown() -> None:
    store, net, client = await setup()
    ledger = await client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3)
    await ledger.add(b"a")
    key = ledger_key(ledger.id)
    current = await store.get(key)
    assert current is not None
    await store.cas(
        key, encode(decode(current.value).evolve(state=LedgerState.IN_RECOVERY)), current.revision
    )
    net.nodes[ledger.metadata.last_segment.ensemble[0]].down = True
    with pytest.raises(AddOutcomeUnknown) as caught:
        await ledger.add(b"b")
    assert caught.value.reason == "in_recovery"
    with pytest.raises(LedgerFencedError):
        await ledger.close()
    await client.close()


async def test_two_recoveries_at_once_agree_on_the_end() -> None:
    store, net, client = await setup(3)
    ledger = await client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
    await ledger.add_batch([b"a", b"b", b"c"])
    others = [Client(store, transport=FakeTransport(net, f"r{i}")) for i in range(3)]
    ends = await asyncio.gather(*(o.recover_ledger(ledger.id) for o in others))
    assert {e["lastEntryId"] for e in ends} == {2}
    assert {e["revision"] for e in ends} == {ends[0]["revision"]}
    for other in others:
        await other.close()
    await client.close()
