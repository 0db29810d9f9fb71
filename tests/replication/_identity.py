"""What the identity tests share: a real etcd, nodes configured for it, the store as the
node sees it (read through the same client code), and a start that must be refused."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from node.client.metadata.etcd import EtcdStore
from node.client.model import cookie_key, node_key
from node.replication.cookie import Cookie
from tests.harness.etcd import EtcdServer
from tests.harness.node import NodeProcess


def fresh_prefix() -> str:
    return f"ident-{uuid.uuid4().hex[:12]}"


def replicated_node(
    data_dir: Path, etcd: EtcdServer, prefix: str, node_id: str, **env: str
) -> NodeProcess:
    return NodeProcess(
        data_dir,
        env={"NODE_METADATA_URL": etcd.url(prefix), "NODE_ID": node_id, **env},
    )


def refused(node: NodeProcess) -> str:
    """Start ``node``, which must exit 2; its output (the refusal)."""
    with pytest.raises(AssertionError, match="node exited with 2"):
        node.start()
    assert node.proc is not None and node.proc.returncode == 2
    return node.log()


async def _get(etcd: EtcdServer, prefix: str, key: str) -> bytes | None:
    store = EtcdStore(etcd.url(prefix))
    try:
        found = await store.get(key)
        return None if found is None else found.value
    finally:
        await store.close()


def store_get(etcd: EtcdServer, prefix: str, key: str) -> bytes | None:
    """A key as the store holds it now (linearizable read)."""
    return asyncio.run(_get(etcd, prefix, key))


async def _keys(etcd: EtcdServer, prefix: str) -> list[str]:
    store = EtcdStore(etcd.url(prefix))
    try:
        return [key for key, _ in await store.range("")]
    finally:
        await store.close()


def store_keys(etcd: EtcdServer, prefix: str) -> list[str]:
    return asyncio.run(_keys(etcd, prefix))


def store_cookie(etcd: EtcdServer, prefix: str, node_id: str) -> Cookie | None:
    value = store_get(etcd, prefix, cookie_key(node_id))
    return None if value is None else Cookie.decode(value, "store")


def registration(etcd: EtcdServer, prefix: str, node_id: str) -> bytes | None:
    return store_get(etcd, prefix, node_key(node_id))
