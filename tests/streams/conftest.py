"""Fixtures of the stream tests: the client tests' metadata stores (a real etcd, one per
session; ``own_etcd`` for a test that pauses it; ``store``: etcd and the in-memory twin)."""

from __future__ import annotations

from tests.client.conftest import etcd, own_etcd, store

__all__ = ["etcd", "own_etcd", "store"]
