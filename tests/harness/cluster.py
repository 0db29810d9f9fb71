"""Fixtures over node/localcluster.py: etcd and real node processes on loopback, and the
fault proxies between the test's clients and those nodes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path

import aiohttp
import pytest

from node.client import Client
from node.jepsen.history import Op, load_async
from node.jepsen.proxy import Direction, Proxy, ProxyMesh
from node.jepsen.workload import ChildWriter, WriterConfig
from node.localcluster import LocalCluster
from tests.harness.hostdisk import HOST_DISK_NEUTRAL, as_env

MakeCluster = Callable[..., LocalCluster]


def cluster_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Nodes that do not care how full the machine's disk is (tests/harness/hostdisk.py)."""
    return {**as_env(HOST_DISK_NEUTRAL), **(extra or {})}


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[MakeCluster]:
    """``make_cluster(nodes=3, zones=None, env=None)``: a cluster under this test's
    temporary directory, closed after the test whatever its outcome."""
    made: list[LocalCluster] = []

    def make(
        nodes: int = 3,
        zones: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> LocalCluster:
        cluster = LocalCluster(
            tmp_path / f"cluster{len(made)}", nodes=nodes, zones=zones, env=cluster_env(env)
        )
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()


@pytest.fixture
def cluster(make_cluster: MakeCluster) -> LocalCluster:
    """etcd and three nodes, n0..n2."""
    return make_cluster()


@pytest.fixture
async def mesh(cluster: LocalCluster) -> AsyncIterator[ProxyMesh]:
    """Proxies between each client of the test and each node (``await mesh.for_client(name)``
    gives that client's address_override)."""
    made = ProxyMesh({node_id: cluster.url(node_id) for node_id in cluster.node_ids})
    yield made
    await made.close()


POLL_S = 0.02  # between two looks at a condition a test waits for
HELD_TIMEOUT_S = 15.0  # for a replica's copy of an acknowledged entry to land


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    """Waits until ``condition()`` holds; fails naming ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(POLL_S)


def answered(proxy: Proxy) -> Callable[[], bool]:
    """True once the node behind ``proxy`` has sent something more than it had so far (its
    answer to the request just sent reached the proxy, whether or not the proxy passed it on)."""
    before = proxy.counters.received[Direction.DOWN]
    return lambda: proxy.counters.received[Direction.DOWN] > before


async def held_by(
    cluster: LocalCluster, ledger_id: int, entry_id: int, nodes: Sequence[str]
) -> None:
    """Waits until every one of ``nodes`` serves ``entry_id``. An add is acknowledged at Qa
    copies, from the first answers' own callbacks: the last copy may still be on its way
    when the writer's call returns, and a test that then stops or kills that node, meaning
    to fault it *after* the add, must wait for its copy first."""
    async with aiohttp.ClientSession() as http:
        for node in nodes:
            url = f"{cluster.url(node)}/api/v1/ledgers/{ledger_id}/entries/{entry_id}"
            deadline = asyncio.get_running_loop().time() + HELD_TIMEOUT_S
            while not await _serves(http, url):
                assert asyncio.get_running_loop().time() < deadline, f"{node} lacks {entry_id}"
                await asyncio.sleep(POLL_S)


async def _serves(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(url) as reply:
        return reply.status == 200


async def last_ensemble(client: Client, ledger_id: int) -> list[str]:
    meta = await client.ledger_metadata(ledger_id)
    return list(meta["segments"][-1]["ensemble"])


async def child_writer(
    cluster: LocalCluster, mesh: ProxyMesh, tmp_path: Path, seed: int, process: str = "w"
) -> tuple[ChildWriter, int]:
    """A writer process behind its own proxies (client ``process`` of ``mesh``), its history
    in ``tmp_path/<process>.jsonl``, started: (it, the id of the ledger it created). The test
    kills it."""
    config = WriterConfig(
        metadata_url=cluster.metadata_url,
        process=process,
        history=str(tmp_path / f"{process}.jsonl"),
        seed=seed,
        address_override=await mesh.for_client(process),
    )
    child = ChildWriter(config, tmp_path / f"{process}.log")
    return child, await child.start()


async def writer_history(child: ChildWriter) -> list[Op]:
    return await load_async([Path(child.config.history)])
