"""The HTTP transport against real node processes: every answer lands in its class. Only the
index's "no such entry/ledger" is absent; an I/O error on the lookup (a failing index, armed by
NODE_FAULTS) is unknown, and so are a wrong node behind the address (421) and a dead address;
a fenced ledger refuses a writer's add and takes a recovery add."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from node.client.bookies import UNREACHABLE, BookieClient
from node.client.errors import ReplicaError
from node.client.metadata.etcd import EtcdStore
from node.client.protocol import ENTRY_NOT_FOUND, LEDGER_NOT_FOUND, WRONG_NODE
from node.client.registry import Registry
from node.localcluster import LocalCluster
from tests.client.realnodes import running_cluster
from tests.harness.ports import free_port

REPLICATION = (2, 2, 1)
LEDGER = 2**62 + 7


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    async with running_cluster(tmp_path / "cluster", 2) as made:
        await asyncio.to_thread(made.restart, "n1", {"NODE_FAULTS": '["index.get=eio"]'})
        yield made


@pytest.fixture
async def registry(nodes: LocalCluster) -> AsyncIterator[EtcdStore]:
    made = EtcdStore(nodes.metadata_url)
    yield made
    await made.close()


async def answer(call: object) -> ReplicaError:
    with pytest.raises(ReplicaError) as caught:
        await call  # type: ignore[misc]
    return caught.value


async def test_answers_are_classified_by_their_code(
    registry: EtcdStore, nodes: LocalCluster
) -> None:
    bookie = BookieClient(Registry(registry))
    add = bookie.add
    await add("n0", LEDGER, [(0, b"a"), (1, b"b")], lac=-1, lac_length=0, replication=REPLICATION)
    await add("n0", LEDGER, [(3, b"d"), (5, b"f")], lac=1, lac_length=2, replication=REPLICATION)
    await add("n0", LEDGER, [(6, b"g")], lac=1, lac_length=2, replication=REPLICATION)
    assert await bookie.read_entry("n0", LEDGER, 5, fence=False) == b"f"
    missing = await answer(bookie.read_entry("n0", LEDGER, 4, fence=False))
    assert missing.absent and missing.code == ENTRY_NOT_FOUND
    unknown = await answer(bookie.read_entry("n0", LEDGER + 1, 0, fence=False))
    assert unknown.absent and unknown.code == LEDGER_NOT_FOUND
    lac = await bookie.read_lac("n0", LEDGER, fence=False, replication=REPLICATION)
    assert (lac.lac, lac.lac_length, lac.last_entry_id, lac.fenced) == (1, 2, 6, False)

    fenced = await bookie.read_lac("n0", LEDGER, fence=True, replication=REPLICATION)
    assert fenced.fenced
    refused = await answer(
        add("n0", LEDGER, [(7, b"h")], lac=1, lac_length=2, replication=REPLICATION)
    )
    assert refused.fenced and not refused.absent
    await bookie.add(
        "n0", LEDGER, [(7, b"h")], lac=1, lac_length=2, replication=REPLICATION, recovery=True
    )
    assert await bookie.read_entry("n0", LEDGER, 7, fence=True) == b"h"

    # A node whose index lookups fail: "not here" would be a lie, so the answer is unknown.
    await add("n1", LEDGER, [(0, b"a")], lac=-1, lac_length=0, replication=REPLICATION)
    failing = await answer(bookie.read_entry("n1", LEDGER, 4, fence=False))
    assert not failing.absent and not failing.fenced and failing.status == 500
    await bookie.close()


async def test_a_wrong_or_dead_address_is_unknown(registry: EtcdStore, nodes: LocalCluster) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    bookie = BookieClient(Registry(registry, {"n1": nodes.url("n0"), "n9": dead}))
    wrong = await answer(bookie.read_entry("n1", LEDGER, 0, fence=False))
    assert wrong.code == WRONG_NODE and wrong.status == 421 and not wrong.absent
    gone = await answer(bookie.read_lac("n9", LEDGER, fence=True, replication=REPLICATION))
    assert gone.code == UNREACHABLE and not gone.absent
    unregistered = await answer(bookie.read_entry("n7", LEDGER, 0, fence=False))
    assert not unregistered.absent
    await bookie.close()


async def test_no_address_while_the_store_is_down_is_unknown() -> None:
    from node.client.errors import StoreUnavailable
    from node.client.metadata.memory import MemoryStore

    class Down(MemoryStore):
        async def range(self, prefix: str) -> list[tuple[str, object]]:  # type: ignore[override]
            raise StoreUnavailable("no endpoint answers")

    bookie = BookieClient(Registry(Down()))
    down = await answer(bookie.read_entry("n0", LEDGER, 0, fence=False))
    assert not down.absent and not down.fenced
    await bookie.close()
