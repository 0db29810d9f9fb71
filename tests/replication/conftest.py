"""Fixtures of the replicated scenarios: etcd and node processes on loopback, proxies."""

from tests.harness.cluster import cluster, make_cluster, mesh  # noqa: F401 (fixtures)
