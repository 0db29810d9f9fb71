"""etcd killed, or its answer lost, in the middle of a metadata change (an ensemble change, a
close), on real processes: when the client is done, what it believes is what etcd holds (TLA+
``NoDivergenceBetweenClientAndMetaData``), and the checker finds every acknowledged entry.

A proxy in front of etcd catches the change's request (a txn): either it is held and etcd
killed (never applied; the client's connection dies unanswered) or it goes in and etcd's
answer is dropped before etcd is killed (applied; the client does not know). Either way the
client must find out by re-reading once etcd is back, neither redo blindly nor give up."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from node.client import Client
from node.client.model import LedgerMetadata
from node.jepsen.checker import check_cluster
from node.jepsen.history import History
from node.jepsen.proxy import DROP, HOLD, Direction, Proxy
from node.jepsen.workload import Writer
from node.localcluster import LocalCluster
from tests.harness.cluster import MakeCluster, held_by, last_ensemble

SEEDS = [1, 2, 3]
WAYS = ["etcd killed", "answer lost"]
TXN = "POST /v3/kv/txn"  # the gateway's request line of a compare-and-set
DOWN_MIN_S = 0.2  # etcd stays down at least ...
DOWN_MAX_S = 1.5  # ... and at most
TRIGGER_TIMEOUT_S = 30.0  # for the change's request to reach the proxy
CHANGE_TIMEOUT_S = 30.0  # for the ensemble change to reach the store once etcd is back


@asynccontextmanager
async def writing(cluster: LocalCluster, seed: int) -> AsyncIterator[tuple[Proxy, Client, Writer]]:
    """A writer (E=Qw=3, Qa=2) that reaches etcd through a proxy, a few entries added."""
    rng = random.Random(seed)
    proxy = await Proxy("127.0.0.1", cluster.etcd.client_port, "etcd").start()
    try:
        url = f"etcd://127.0.0.1:{proxy.port}/{cluster.prefix}"
        async with Client(url, rng=random.Random(seed)) as client:
            writer = await Writer.create(client, History("w"), rng, 3, 3, 2)
            for _ in range(rng.randint(1, 10)):
                assert await writer.add() >= 0
            yield proxy, client, writer
    finally:
        await proxy.close()


async def lose_a_change(
    way: str, cluster: LocalCluster, proxy: Proxy, rng: random.Random, start: Callable[[], None]
) -> None:
    """Runs ``start`` (which leads to the change) and catches the change's request at the
    proxy: "etcd killed" holds the request and kills etcd (the client's connection dies with
    the request unanswered, not applied); "answer lost" lets it in and drops etcd's answer,
    then etcd is killed (applied, the client does not know). etcd comes back after a while."""
    if way == "etcd killed":
        proxy.on_request(TXN, HOLD, Direction.UP)
    else:
        proxy.on_request(TXN, DROP, Direction.DOWN)
    start()
    await asyncio.wait_for(proxy.triggered.wait(), TRIGGER_TIMEOUT_S)
    await asyncio.sleep(rng.uniform(0, DOWN_MIN_S))  # an answer lost: applied meanwhile
    await asyncio.to_thread(cluster.kill_etcd)
    await asyncio.sleep(rng.uniform(DOWN_MIN_S, DOWN_MAX_S))
    await asyncio.to_thread(cluster.restart_etcd)
    proxy.heal()


def agree(handle_meta: LedgerMetadata, store_meta: dict[str, Any]) -> None:
    """The writer's metadata is the store's."""
    view = handle_meta.to_json()
    for field in ("state", "lastEntryId", "length", "segments"):
        assert view[field] == store_meta[field], (field, view[field], store_meta[field])


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("seed", SEEDS)
async def test_etcd_lost_during_a_close(cluster: LocalCluster, seed: int, way: str) -> None:
    async with writing(cluster, seed) as (proxy, client, writer):
        closing: list[asyncio.Future[int]] = []
        start = lambda: closing.append(asyncio.ensure_future(writer.close()))  # noqa: E731
        await lose_a_change(way, cluster, proxy, writer.rng, start)
        closed_at = await closing[0]
        assert closed_at == writer.last_ok, "the close did not end at the writer's LAC"
        store_meta = await client.ledger_metadata(writer.ledger.id)
        assert store_meta["state"] == "CLOSED"
        agree(writer.ledger.metadata, store_meta)
    verdict = await check_cluster(writer.history.ops, cluster.metadata_url)
    assert verdict.ok, verdict


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("seed", SEEDS)
async def test_etcd_lost_during_an_ensemble_change(
    make_cluster: MakeCluster, seed: int, way: str
) -> None:
    cluster = await asyncio.to_thread(make_cluster, 4)
    async with writing(cluster, seed) as (proxy, client, writer):
        ensemble = await last_ensemble(client, writer.ledger.id)
        victim = writer.rng.choice(ensemble)
        # Its copy of the last add may still be on its way (acknowledged at Qa = 2): killed
        # before it lands, that add's failure would start the change before the proxy waits.
        await held_by(cluster, writer.ledger.id, writer.last_ok, ensemble)
        await asyncio.to_thread(cluster.kill, victim)
        await lose_a_change(way, cluster, proxy, writer.rng, lambda: writer.spawn(4))
        await writer.wait_pending()
        types = {op.type for op in writer.history.ops}
        assert types == {"invoke", "ok"}, "an add did not succeed"
        # The adds needed Qa = 2 copies, not the victim's: they may all be answered while the
        # change that replaces it is still retrying against the etcd that came back.
        deadline = asyncio.get_running_loop().time() + CHANGE_TIMEOUT_S
        while (
            victim in await last_ensemble(client, writer.ledger.id)
            or victim in writer.ledger.metadata.to_json()["segments"][-1]["ensemble"]
        ):
            assert asyncio.get_running_loop().time() < deadline, f"{victim} never replaced"
            await asyncio.sleep(0.1)
        store_meta = await client.ledger_metadata(writer.ledger.id)
        agree(writer.ledger.metadata, store_meta)
        assert await writer.close() == writer.last_ok
    verdict = await check_cluster(writer.history.ops, cluster.metadata_url)
    assert verdict.ok, verdict
