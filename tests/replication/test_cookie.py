"""The cookie: every row of the start table, with a real etcd and real node processes. A
data directory that is not the one the store knows (wiped, swapped, another cluster's, a
journal of another instance) makes the node exit 2 naming what differs and what to run."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from node.client.metadata.etcd import EtcdStore
from node.client.model import CLUSTER_KEY, cookie_key
from node.replication import cookie
from node.replication.cookie import COOKIE_FILE, Cookie
from node.settings import Settings
from node.storage import journalformat, walid
from tests.harness.etcd import EtcdServer
from tests.harness.node import NodeProcess
from tests.replication._identity import (
    fresh_prefix,
    refused,
    replicated_node,
    store_cookie,
    store_get,
    store_keys,
)

READD = "python -m node shell readd"


def _journal_headers(data_dir: Path) -> list[bytes | None]:
    found = []
    for journal_id in journalformat.list_journals(data_dir / "journal"):
        with journalformat.journal_path(data_dir / "journal", journal_id).open("rb") as f:
            found.append(journalformat.header_instance_id(f.read(journalformat.HEADER_SIZE)))
    return found


def _local(data_dir: Path) -> Cookie:
    found = cookie.read_local(data_dir)
    assert found is not None
    return found


def _started_once(tmp_path: Path, etcd: EtcdServer, **env: str) -> tuple[NodeProcess, str, Cookie]:
    """Node n1 after one start against a fresh prefix (its cookie written) and a SIGKILL:
    the node, its prefix and its cookie."""
    prefix = fresh_prefix()
    node = replicated_node(tmp_path / "n1", etcd, prefix, "n1", **env)
    node.start()
    node.kill()
    return node, prefix, _local(node.data_dir)


def test_journal_header_carries_the_instance_and_old_headers_still_read() -> None:
    instance = uuid.uuid4().bytes
    header = journalformat.encode_header(instance)
    assert len(header) == journalformat.HEADER_SIZE
    assert journalformat.decode_header(header) == journalformat.VERSION == 3
    assert journalformat.header_instance_id(header) == instance
    no_cookie = journalformat.encode_header()  # zeros
    assert journalformat.header_instance_id(no_cookie) is None
    version2 = journalformat.HEADER.pack(journalformat.MAGIC, 2).ljust(
        journalformat.HEADER_SIZE, b"\0"
    )
    assert journalformat.decode_header(version2) == 2
    assert journalformat.header_instance_id(version2) is None


def test_new_node_writes_its_cookie_in_three_places_and_keeps_it(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    prefix = fresh_prefix()
    node = replicated_node(tmp_path / "n1", etcd, prefix, "n1")
    node.start()
    local = _local(node.data_dir)
    assert store_cookie(etcd, prefix, "n1") == local
    assert local.node_id == "n1" and local.wal_kind == "journal"
    cluster = json.loads(store_get(etcd, prefix, CLUSTER_KEY) or b"{}")
    assert cluster["clusterId"] == local.cluster_id
    assert _journal_headers(node.data_dir) == [local.instance_bytes]

    # A second node joins the same cluster; the cluster key is never rewritten.
    other = replicated_node(tmp_path / "n2", etcd, prefix, "n2")
    other.start()
    assert _local(other.data_dir).cluster_id == local.cluster_id
    assert _local(other.data_dir).instance_id != local.instance_id
    assert json.loads(store_get(etcd, prefix, CLUSTER_KEY) or b"{}") == cluster

    # Normal start after a crash: same instance, a new journal with the same header.
    node.kill()
    node.start()
    assert _local(node.data_dir) == local == store_cookie(etcd, prefix, "n1")
    assert _journal_headers(node.data_dir) == [local.instance_bytes] * 2


def test_first_start_that_died_before_the_store_write_is_finished(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    node, prefix, local = _started_once(tmp_path, etcd)

    async def drop() -> None:  # as if the first start died between its two writes
        store = EtcdStore(etcd.url(prefix))
        found = await store.get(cookie_key("n1"))
        assert found is not None
        await store.delete(cookie_key("n1"), found.revision)
        await store.close()

    asyncio.run(drop())
    assert store_cookie(etcd, prefix, "n1") is None
    node.start()
    assert store_cookie(etcd, prefix, "n1") == local == _local(node.data_dir)


def test_wiped_data_dir_under_the_same_id_is_refused_until_readd(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    node, prefix, old = _started_once(tmp_path, etcd)
    shutil.rmtree(node.data_dir)

    log = refused(node)
    assert f"{READD} n1" in log and old.instance_id in log and "wiped" in log
    assert store_cookie(etcd, prefix, "n1") == old  # the refusal changed nothing
    assert not (node.data_dir / COOKIE_FILE).exists()

    async def readd() -> Cookie | None:
        store = EtcdStore(etcd.url(prefix))
        try:
            return await cookie.retire(store, "n1")
        finally:
            await store.close()

    assert asyncio.run(readd()) == old
    assert f"retired/n1/{old.instance_id}" in store_keys(etcd, prefix)
    node.start()  # a new instance now
    new = _local(node.data_dir)
    assert new.instance_id != old.instance_id and new.cluster_id == old.cluster_id
    assert store_cookie(etcd, prefix, "n1") == new


def test_retired_instance_cannot_come_back(tmp_path: Path, etcd: EtcdServer) -> None:
    """`readd` recovered the node's ledgers without it: its old data directory, brought
    back afterwards (the volume was only detached), must not serve them."""
    node, prefix, old = _started_once(tmp_path, etcd)

    async def retire() -> None:
        store = EtcdStore(etcd.url(prefix))
        await cookie.retire(store, "n1")
        await store.close()

    asyncio.run(retire())
    log = refused(node)
    assert "retired" in log and old.instance_id in log
    assert store_cookie(etcd, prefix, "n1") is None


def test_swapped_data_dir_is_refused_naming_both_instances(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    node, prefix, stored = _started_once(tmp_path, etcd)
    other = Cookie(stored.cluster_id, "n1", str(uuid.uuid4()), stored.created_ms, "journal")
    cookie.write_local(node.data_dir, other)
    # Its journals must agree with it, or the journal check would speak first.
    for path in (node.data_dir / "journal").glob("*.txn"):
        path.unlink()

    log = refused(node)
    assert other.instance_id in log and stored.instance_id in log
    assert COOKIE_FILE in log and cookie_key("n1") in log and f"{READD} n1" in log
    assert store_cookie(etcd, prefix, "n1") == stored


def test_journal_of_another_instance_is_refused(tmp_path: Path, etcd: EtcdServer) -> None:
    node, _, local = _started_once(tmp_path, etcd)
    stranger = uuid.uuid4()
    ids = journalformat.list_journals(node.data_dir / "journal")
    path = journalformat.journal_path(node.data_dir / "journal", ids[-1] + 1)
    path.write_bytes(journalformat.encode_header(stranger.bytes))

    log = refused(node)
    assert str(stranger) in log and local.instance_id in log and path.name in log


def test_data_dir_with_a_cookie_is_refused_without_a_metadata_store(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    node, _, local = _started_once(tmp_path, etcd)

    alone = NodeProcess(node.data_dir)
    log = refused(alone)
    assert "NODE_METADATA_URL" in log and local.instance_id in log


def test_node_pointed_at_an_empty_prefix_refuses_and_writes_nothing_there(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    node, _, local = _started_once(tmp_path, etcd)

    empty = fresh_prefix()
    wrong = replicated_node(node.data_dir, etcd, empty, "n1")
    log = refused(wrong)
    assert local.cluster_id in log and "no cluster" in log
    assert store_keys(etcd, empty) == []
    assert _local(node.data_dir) == local


def test_data_dir_of_another_node_id_is_refused(tmp_path: Path, etcd: EtcdServer) -> None:
    node, prefix, _ = _started_once(tmp_path, etcd)
    log = refused(replicated_node(node.data_dir, etcd, prefix, "n2"))
    assert "n1" in log and "n2" in log and "NODE_ID" in log
    assert store_cookie(etcd, prefix, "n2") is None


def test_unreachable_store_refuses_the_start(tmp_path: Path, etcd: EtcdServer) -> None:
    from tests.harness.ports import free_port

    node = NodeProcess(
        tmp_path / "n1",
        env={"NODE_METADATA_URL": f"etcd://127.0.0.1:{free_port()}/x", "NODE_ID": "n1"},
    )
    log = refused(node)
    assert "metadata store" in log
    assert not (node.data_dir / COOKIE_FILE).exists()


def test_without_a_metadata_store_no_store_code_loads(tmp_path: Path) -> None:
    """Without metadata_url the node loads neither the store's client nor registration nor
    the replica GC (the HTTP side's wire names from node.client.protocol are another matter)."""
    code = (
        "import sys\n"
        "from node.settings import load\n"
        "from node.http.app import build_app\n"
        "import node.cli\n"
        f"settings = load(None, data_dir={str(tmp_path)!r})\n"
        "build_app(settings)\n"
        "print(sorted(m for m in sys.modules if m in UNWANTED))\n"
    ).replace("UNWANTED", repr(NOT_WITHOUT_A_STORE))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]", done.stdout


NOT_WITHOUT_A_STORE = (
    "node.client.metadata.etcd",
    "node.replication.service",
    "node.replication.registration",
    "node.replication.reconcile",
)


@pytest.mark.parametrize("row", ["new", "normal"])
async def test_check_against_the_store_in_process(
    tmp_path: Path, etcd: EtcdServer, row: str
) -> None:
    """The same function the node runs, called directly: a new node's cookie, then a
    normal start that returns it unchanged and writes nothing."""
    from tests.harness.settings import make_settings

    prefix = fresh_prefix()
    settings = make_settings(tmp_path / "data", metadata_url=etcd.url(prefix), id="n7")
    store = EtcdStore(settings.metadata_url)
    try:
        made = await cookie.check(settings, store)
        if row == "normal":
            before = await store.range("")
            assert await cookie.check(settings, store) == made
            assert await store.range("") == before
        assert Cookie.decode((await store.get(cookie_key("n7"))).value, "s") == made  # type: ignore[union-attr]
    finally:
        await store.close()


def test_ring_header_carries_the_instance_and_version_2_still_reads() -> None:
    from node.storage import ringformat
    from node.storage.ringformat import Shutdown, WalHeader

    instance = uuid.uuid4().bytes
    header = WalHeader(1 << 20, 8192, 7, 1, 4096, 3, Shutdown.GRACEFUL, instance_id=instance)
    assert ringformat.decode_header(ringformat.encode_header(header)) == header
    old = header._replace(version=2, instance_id=ringformat.NO_INSTANCE)
    data = ringformat.encode_header(old)
    assert len(data) == 72  # version 2's layout, as rings written before hold it
    assert ringformat.decode_header(data.ljust(ringformat.HEADER_SLOT_SIZE, b"\0")) == old


def test_ring_of_another_instance_is_refused(tmp_path: Path, etcd: EtcdServer) -> None:
    from node.storage import ringformat

    ring = tmp_path / "wal.img"
    node, _, local = _started_once(
        tmp_path,
        etcd,
        NODE_WAL_KIND="blockdev",
        NODE_WAL_PATH=str(ring),
        NODE_WAL_CAPACITY=str(16 << 20),
    )
    assert walid.wal_instances(node_settings(node)) == [(str(ring), local.instance_id)]

    # The ring's newest header now names another instance (a volume of another pod).
    data = ring.read_bytes()[: ringformat.HEADER_AREA]
    slots = [
        ringformat.decode_header(data[i * ringformat.HEADER_SLOT_SIZE :])
        for i in range(ringformat.HEADER_SLOTS)
    ]
    newest = max(slots, key=lambda h: h.sequence)
    stranger = uuid.uuid4()
    forged = newest._replace(sequence=newest.sequence + 1, instance_id=stranger.bytes)
    with ring.open("r+b") as f:
        f.seek((forged.sequence % ringformat.HEADER_SLOTS) * ringformat.HEADER_SLOT_SIZE)
        f.write(ringformat.encode_header(forged))

    log = refused(node)
    assert str(stranger) in log and local.instance_id in log and str(ring) in log


def node_settings(node: NodeProcess) -> Settings:
    from tests.harness.settings import make_settings

    return make_settings(
        node.data_dir,
        wal_kind=node.env["NODE_WAL_KIND"],
        wal_path=Path(node.env["NODE_WAL_PATH"]),
        wal_capacity=int(node.env["NODE_WAL_CAPACITY"]),
    )
