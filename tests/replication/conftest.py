"""Fixtures of the replication tests: a real etcd (the client tests' own fixtures: one per
session, and ``own_etcd`` for a test that kills and restarts it) and the local clusters of
tests/harness/cluster.py."""

from __future__ import annotations

from tests.client.conftest import etcd, own_etcd
from tests.harness.cluster import cluster, make_cluster, mesh

__all__ = ["cluster", "etcd", "make_cluster", "mesh", "own_etcd"]
