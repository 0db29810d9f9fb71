"""A real single-member etcd on free loopback ports for the tests: node/localcluster.py's
launcher (one copy), which fails naming `make tools` when etcd is not installed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from node.client.metadata.etcd import EtcdStore
from node.localcluster import EtcdProcess

EtcdServer = EtcdProcess


@contextmanager
def running_etcd(work_dir: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(work_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def _write(etcd: EtcdServer, prefix: str, key: str, value: bytes) -> None:
    store = EtcdStore(etcd.url(prefix))
    try:
        found = await store.get(key)
        if found is None:
            await store.create(key, value)
        else:
            await store.cas(key, value, found.revision)
    finally:
        await store.close()


def store_write(etcd: EtcdServer, prefix: str, key: str, value: dict[str, Any] | bytes) -> None:
    """Put ``key`` under ``prefix`` (JSON for a dict), as another process of the fleet would:
    through the client's store, created or replaced by a CAS."""
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    # A thread of its own: the caller's thread may run an event loop already (Playwright's).
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, _write(etcd, prefix, key, raw)).result()
