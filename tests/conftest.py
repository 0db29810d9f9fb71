"""Shared fixtures: real files, real RocksDB, the real HTTP server on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import BaseTestServer, TestClient, TestServer
from blockbuster import blockbuster_ctx

from node.http.app import NodeRunner, build_app
from node.settings import Settings, load
from node.storage.ledgers import LedgerStorage
from tests.hostdisk import HOST_DISK_NEUTRAL


def make_settings(data_dir: Path, **overrides: Any) -> Settings:
    """Settings for tests: small enough to exercise rolls and swaps quickly."""
    base: dict[str, Any] = {
        **HOST_DISK_NEUTRAL,
        "data_dir": data_dir,
        "journal_pre_alloc_size": 1 << 20,
        "db_storage_write_cache_max_size": 16 << 20,
        "db_storage_read_ahead_cache_max_size": 4 << 20,
        "max_entry_size": 1 << 20,
        "max_request_size": 8 << 20,
    }
    base.update(overrides)
    return load(**base)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path / "data")


@pytest.fixture
async def storage(settings: Settings) -> AsyncIterator[LedgerStorage]:
    engine = LedgerStorage(settings)
    await engine.start()
    yield engine
    await engine.close()


class NodeTestServer(TestServer):
    """aiohttp's test server with the node's runner: connections start in the fast lane
    (node/http/fastlane.py) and reach aiohttp's handler as ``serve`` hands them over."""

    async def _make_runner(self, **kwargs: Any) -> NodeRunner:
        return NodeRunner(self.app, **kwargs)


@pytest.fixture
def aiohttp_client(aiohttp_client: Any) -> Any:
    """pytest-aiohttp's, serving an application as ``serve`` does (NodeTestServer)."""

    async def make(app_or_server: web.Application | BaseTestServer, **kwargs: Any) -> Any:
        if isinstance(app_or_server, web.Application):
            app_or_server = NodeTestServer(app_or_server)
        return await aiohttp_client(app_or_server, **kwargs)

    return make


@pytest.fixture
async def client(settings: Settings, aiohttp_client: Any) -> TestClient[Any, Any]:
    return await aiohttp_client(build_app(settings))  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def no_blocking_io_on_the_loop() -> Iterator[None]:
    """aiohttp's discipline: a test fails when the node's code blocks the event loop with
    file or socket I/O, a lock or a sleep (blockbuster patches those calls and raises when
    they run on a thread with a running loop). Test code itself is exempt."""
    with blockbuster_ctx(excluded_modules=["tests"]):
        yield
