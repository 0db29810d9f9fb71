"""Fixtures of the replication tests: a real etcd (the client tests' own fixtures: one per
session, and ``own_etcd`` for a test that kills and restarts it)."""

from __future__ import annotations

from tests.client.conftest import etcd, own_etcd

__all__ = ["etcd", "own_etcd"]
