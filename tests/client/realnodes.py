"""etcd and real node processes for the client's tests (node/localcluster.py), with each node's
registration in ``nodes/`` as the node puts it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from node.client.metadata.etcd import EtcdStore
from node.client.model import NodeInfo, node_key
from node.localcluster import LocalCluster
from tests.harness.cluster import cluster_env

REGISTRATION_TTL_S = 600  # outlives any test


@contextlib.asynccontextmanager
async def running_cluster(root: Path, nodes: int) -> AsyncIterator[LocalCluster]:
    made = await asyncio.to_thread(
        LocalCluster, root, nodes=nodes, env=cluster_env(), register=False
    )
    try:
        await register(made)
        yield made
    finally:
        await asyncio.to_thread(made.close)


async def register(cluster: LocalCluster) -> None:
    store = EtcdStore(cluster.metadata_url)
    try:
        lease = await store.grant_lease(REGISTRATION_TTL_S)
        for node_id in cluster.node_ids:
            info = NodeInfo(node_id, cluster.url(node_id))
            await store.put(node_key(node_id), info.encode(), lease=lease)
    finally:
        await store.close()
