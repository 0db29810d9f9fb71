"""Fixtures of the stream tests: the client tests' metadata stores (a real etcd, one per
session; ``own_etcd`` for a test that pauses it; ``store``: etcd and the in-memory twin), and
``stream_cluster``: etcd and four node processes (after one is lost, three remain to form a
new ensemble of three), with a short owner lease so that takeovers come quickly."""

from __future__ import annotations

import pytest

from node.localcluster import LocalCluster
from tests.client.conftest import etcd, own_etcd, store
from tests.harness.cluster import MakeCluster, make_cluster

__all__ = ["etcd", "make_cluster", "own_etcd", "store", "stream_cluster"]

NODES = 4
OWNER_TTL_S = 3  # stream_owner_ttl_s: a lost owner's lease ends this long after its last keepalive
STREAM_CLUSTER_ENV = {
    "NODE_STREAM_OWNER_TTL_S": str(OWNER_TTL_S),
    "NODE_RETENTION_SCHEDULER_ENABLED": "false",  # only a test runs retention
    # A deleted stream's replicas are reclaimed within a second or two, not ten minutes.
    "NODE_REPLICATION_GC_INTERVAL_S": "1",
    "NODE_REPLICATION_GC_GRACE_S": "0",
}


@pytest.fixture
def stream_cluster(make_cluster: MakeCluster) -> LocalCluster:
    """etcd and nodes n0..n3 sharing it as their metadata store."""
    return make_cluster(nodes=NODES, env=STREAM_CLUSTER_ENV)
