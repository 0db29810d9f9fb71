"""The metadata stores of the client tests: a real etcd (one per session; a test that stops or
restarts etcd starts its own with ``own_etcd``) and the in-memory twin."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from node.client.metadata.etcd import EtcdStore
from node.client.metadata.memory import MemoryStore
from node.client.metadata.store import MetadataStore
from tests.harness.etcd import EtcdServer, running_etcd


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test's own, which it may pause, kill and restart."""
    with running_etcd(tmp_path) as server:
        yield server


@pytest.fixture(params=["etcd", "memory"])
async def store(request: pytest.FixtureRequest, etcd: EtcdServer) -> AsyncIterator[MetadataStore]:
    """Each store under a prefix of its own, so tests sharing the session's etcd never meet."""
    made: MetadataStore
    if request.param == "etcd":
        made = EtcdStore(etcd.url(f"test-{uuid.uuid4().hex[:12]}"))
    else:
        made = MemoryStore()
    yield made
    await made.close()
