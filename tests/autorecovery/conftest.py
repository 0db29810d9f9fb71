"""Fixtures of the autorecovery tests: real etcd and real node processes (tests/harness)."""

from __future__ import annotations

from tests.harness.cluster import make_cluster

__all__ = ["make_cluster"]
