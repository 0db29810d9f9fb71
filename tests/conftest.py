"""Shared fixtures: real files, real RocksDB, the real HTTP server on loopback, moto's S3
server. What they are built from lives in tests/harness/."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import BaseTestServer, TestClient, TestServer
from blockbuster import blockbuster_ctx

from node.http.app import NodeRunner, build_app
from node.settings import Settings
from node.storage.ledgers import LedgerStorage
from tests.harness.moto import MotoServer, aws_variables
from tests.harness.node import reap_nodes  # noqa: F401 (an autouse fixture, for every test)
from tests.harness.settings import make_settings

# The longest files (wall time per file, -n 4), longest first: `make test` hands whole files to
# its workers in collection order (--no-loadscope-reorder: xdist would otherwise put the files
# with the most tests first, and the long files of one or two tests, Airflow's and Spark's,
# ran last while the other workers idled), so longest first keeps them all busy to the end.
LONGEST_FILES = (
    "tests/airflow/test_local.py",
    "tests/crash/test_crash_blockdev.py",
    "tests/audit/test_audit.py",
    "tests/airflow/test_runs.py",
    "tests/client/test_shell.py",
    "tests/deploy/test_image.py",
    "tests/streams/test_replicated_streams.py",
    "tests/lifecycle/test_full_disk.py",
    "tests/storage/test_blockwal.py",
    "tests/replication/test_scenarios_etcd.py",
    "tests/audit/test_snapshot_disk.py",
    "tests/bench/test_audit.py",
    "tests/streams/test_replicated_faults.py",
    "tests/streams/test_stream_crash.py",
    "tests/crash/test_crash.py",
    "tests/test_readme.py",
    "tests/streams/test_replicated_availability.py",
    "tests/replication/test_scenarios_fencing.py",
    "tests/http/test_openapi.py",
    "tests/airflow/test_autorecovery_run.py",
    "tests/bench/test_stream_replicated.py",
    "tests/audit/test_replicas.py",
    "tests/audit/test_live.py",
    "tests/autorecovery/test_autorecovery.py",
    "tests/crash/test_faults.py",
    "tests/streams/test_dedup_replicated.py",
    "tests/audit/test_fleet.py",
    "tests/crash/test_mixed_workload.py",
    "tests/lifecycle/test_gc_simulation.py",
    "tests/http/test_many_streams.py",
    "tests/lifecycle/test_gc_crash.py",
    "tests/status/test_page.py",
    "tests/airflow/test_audit_cluster.py",
    "tests/airflow/test_audit_replicas.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: every file keeps its own order


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


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """One moto S3 server for the session (offload and DAG tests); each test makes its own
    bucket."""
    for name in aws_variables():
        del os.environ[name]
    server = MotoServer()
    server.start()
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def no_blocking_io_on_the_loop() -> Iterator[None]:
    """aiohttp's discipline: a test fails when the node's code blocks the event loop with
    file or socket I/O, a lock or a sleep (blockbuster patches those calls and raises when
    they run on a thread with a running loop). Test code itself is exempt."""
    with blockbuster_ctx(excluded_modules=["tests"]):
        yield
