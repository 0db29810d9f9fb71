"""Fixtures of the autorecovery tests: real etcd and real node processes (tests/harness)."""

from __future__ import annotations

from tests.client.conftest import etcd
from tests.harness.cluster import make_cluster

__all__ = ["etcd", "make_cluster"]
