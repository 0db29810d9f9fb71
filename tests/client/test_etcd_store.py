"""EtcdStore against a real etcd: its URLs, the gateway's encodings, and what it answers when
etcd stops, dies, or comes back."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.client.errors import MetadataUrlError, OutcomeUnknown, StoreUnavailable
from node.client.metadata.etcd import DEFAULT_TIMEOUT_S, EtcdStore, parse_url
from tests.harness.etcd import EtcdServer
from tests.harness.ports import free_port

# what a call may take beyond its timeout before the test calls it a hang
SLACK_S = 2.0


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("http://127.0.0.1:2379/p", "scheme must be etcd://"),
        ("etcd:///p", "no endpoint"),
        ("etcd://127.0.0.1/p", "is not host:port"),
        ("etcd://127.0.0.1:2379,:2380/p", "':2380' is not host:port"),
        ("etcd://127.0.0.1:99999/p", "is not host:port"),
        ("etcd://127.0.0.1:port/p", "is not host:port"),
        ("etcd://127.0.0.1:2379", "a key prefix is required"),
        ("etcd://127.0.0.1:2379/", "a key prefix is required"),
        ("etcd://user@127.0.0.1:2379/p", "no user, query or fragment"),
        ("etcd://127.0.0.1:2379/p?x=1", "no user, query or fragment"),
    ],
)
def test_bad_urls_are_refused_with_the_form_to_use(url: str, complaint: str) -> None:
    with pytest.raises(MetadataUrlError, match=complaint) as refused:
        EtcdStore(url)
    assert "etcd://host:port[,host:port...]/prefix" in str(refused.value)


def test_a_url_gives_endpoints_and_prefix() -> None:
    assert parse_url("etcd://h1:2379,h2:2379/storage") == (
        ["http://h1:2379", "http://h2:2379"],
        "/storage/",
    )
    assert parse_url("etcd://[::1]:2379/a/b/") == (["http://[::1]:2379"], "/a/b/")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    key=st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40),
    value=st.binary(max_size=2000),
)
async def test_keys_and_values_round_trip_through_the_gateway(
    etcd: EtcdServer, key: str, value: bytes
) -> None:
    store = EtcdStore(etcd.url(f"rt-{uuid.uuid4().hex[:12]}"))
    try:
        made = await store.create(key, value)
        assert await store.get(key) == made
        assert await store.range("") == [(key, made)]
    finally:
        await store.close()


async def test_a_stopped_etcd_makes_calls_fail_in_time_and_a_resumed_one_answers(
    own_etcd: EtcdServer,
) -> None:
    """SIGSTOP: connections are accepted, nothing answers. Reads are StoreUnavailable, changes
    OutcomeUnknown (they were sent), each within the default timeout: no hang."""
    store = EtcdStore(own_etcd.url("paused"))
    try:
        first = await store.create("k", b"v1")
        own_etcd.pause()
        try:
            began = time.monotonic()
            failed = await asyncio.gather(
                store.get("k"),
                store.cas("k", b"v2", first.revision),
                store.next_id(),
                store.commit({"k": first.revision}, {"k": b"v3"}),
                return_exceptions=True,
            )
            assert time.monotonic() - began < DEFAULT_TIMEOUT_S + SLACK_S
            assert [type(error) for error in failed] == [
                StoreUnavailable,
                OutcomeUnknown,
                OutcomeUnknown,
                OutcomeUnknown,
            ]
        finally:
            own_etcd.resume()
        # the cas and the commit were sent: once etcd runs again either may have applied (not
        # both: each needs the first revision); a read tells
        now = await store.get("k")
        assert now is not None and now.value in (b"v1", b"v2", b"v3")
    finally:
        await store.close()


async def test_a_killed_etcd_is_unavailable_and_a_restarted_one_answers(
    own_etcd: EtcdServer,
) -> None:
    store = EtcdStore(own_etcd.url("restart"))
    try:
        first = await store.create("k", b"v1")
        await asyncio.to_thread(own_etcd.kill)
        began = time.monotonic()
        with pytest.raises(StoreUnavailable, match="no endpoint"):
            await store.cas("k", b"v2", first.revision)  # refused: nothing was sent
        assert time.monotonic() - began < SLACK_S
        await asyncio.to_thread(own_etcd.start)
        assert await store.get("k") == first  # acknowledged before the kill: durable
        assert (await store.cas("k", b"v2", first.revision)).value == b"v2"
    finally:
        await store.close()


async def test_a_refused_endpoint_is_skipped_for_the_next(etcd: EtcdServer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    store = EtcdStore(f"etcd://{dead},127.0.0.1:{etcd.client_port}/failover-{uuid.uuid4().hex}")
    try:
        made = await store.create("k", b"v")
        assert await store.get("k") == made
    finally:
        await store.close()


def test_the_client_imports_nothing_of_the_node() -> None:
    """Scripts and the Airflow venv use node.client: it must not pull in the engine or the
    server (the node imports the client's wire and metadata modules, never the reverse)."""
    code = (
        "import sys, node.client, node.client.sync, node.client.metadata.etcd, "
        "node.client.metadata.loop, node.client.metadata.memory; "
        "print(sorted(m for m in sys.modules if m.startswith('node.') "
        "and not m.startswith('node.client')))"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert found.strip() == "[]"


def test_a_node_without_a_metadata_store_loads_only_the_clients_wire_modules() -> None:
    """The node's HTTP layer speaks the replica protocol on every start; the writer, reader
    and recovery load only when something uses the client (``node.client`` is lazy)."""
    code = (
        "import sys, node.http.app; "
        "print(sorted(m for m in sys.modules if m.startswith('node.client')))"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    loaded = set(ast.literal_eval(found))
    assert loaded, "node.http.app no longer imports the replica protocol?"
    assert not loaded & {
        "node.client.client",
        "node.client.writer",
        "node.client.reader",
        "node.client.recovery",
    }


async def test_a_watch_ends_with_etcd_and_resumes_from_the_last_revision_seen(
    own_etcd: EtcdServer,
) -> None:
    store = EtcdStore(own_etcd.url("watch"))
    try:
        first = await store.create("nodes/n1", b"writable")
        changes = store.watch("nodes/", first.revision)
        assert (await anext(changes)).value == first
        await asyncio.to_thread(own_etcd.kill)
        with pytest.raises(StoreUnavailable):
            async with asyncio.timeout(DEFAULT_TIMEOUT_S):
                await anext(changes)
        await asyncio.to_thread(own_etcd.start)
        second = await store.cas("nodes/n1", b"readonly", first.revision)
        resumed = store.watch("nodes/", first.revision + 1)
        assert (await anext(resumed)).value == second
        await resumed.aclose()  # type: ignore[attr-defined]
    finally:
        await store.close()
