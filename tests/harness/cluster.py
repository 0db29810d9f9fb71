"""Fixtures over node/localcluster.py: etcd and real node processes on loopback, and the
fault proxies between the test's clients and those nodes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from node.jepsen.proxy import ProxyMesh
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
