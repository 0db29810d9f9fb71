"""Fixtures of the checker's tests on real processes: tests/harness/cluster.py's clusters."""

from __future__ import annotations

from tests.harness.cluster import cluster, make_cluster

__all__ = ["cluster", "make_cluster"]
