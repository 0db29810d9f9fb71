"""The bookie protocol of replicated ledgers on the node's routes (node/http/ledgers.py,
the fast lane): the real server on loopback, a real engine on real files. The header names
and codes are node/client/protocol.py's, as the client sends and reads them."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from node.client import protocol
from node.client.errors import StoreUnavailable
from node.client.metadata.store import LEDGER_ID_BASE
from node.http.app import build_app
from node.http.fastlane import SERVER_HEADER
from node.http.state import METRICS, REPLICA_GUARD, STORAGE
from node.storage.index import UNKNOWN_REPLICATION
from tests.harness.files import flip_byte
from tests.harness.settings import make_settings

Client = TestClient[Any, Any]
NODE = "bookie-a"
LID = LEDGER_ID_BASE + 7


def _replica(first: int, lac: int = -1, recovery: bool = False, **extra: str) -> dict[str, str]:
    headers = {
        protocol.REPLICATED_HEADER: protocol.replication_header(3, 2, 2),
        protocol.ENTRY_ID_HEADER: str(first),
        protocol.LAC_HEADER: str(lac),
        protocol.LAC_LENGTH_HEADER: str(max(0, lac + 1) * 10),
        **extra,
    }
    if recovery:
        headers[protocol.RECOVERY_ADD_HEADER] = "1"
    return headers


@pytest.fixture
async def node(tmp_path: Path, aiohttp_client: Any) -> Client:
    settings = make_settings(tmp_path / "data", id=NODE)
    return await aiohttp_client(build_app(settings))  # type: ignore[no-any-return]


async def _add(client: Client, ledger: int, first: int, body: bytes, **kw: Any) -> Any:
    return await client.post(
        f"/api/v1/ledgers/{ledger}/entries",
        data=body,
        headers={"Content-Type": protocol.OCTET_CONTENT_TYPE, **_replica(first, **kw)},
    )


async def _json(response: Any, status: int) -> Any:
    body = await response.json()
    assert response.status == status, body
    assert response.headers[protocol.NODE_ID_HEADER] == NODE
    return body


async def test_replica_add_creates_the_ledger_and_reads_serve_a_stripe(node: Client) -> None:
    # A stripe (E=3, Qw=2): this replica holds 0, 1, 3, 4, never 2.
    for eid in (0, 1, 3, 4):
        response = await _add(node, LID, eid, b"e%d" % eid, lac=eid - 1)
        assert response.headers["Server"] == SERVER_HEADER.decode()  # the fast lane answered
        body = await _json(response, 201)
        assert body == {
            "ledgerId": LID,
            "firstEntryId": eid,
            "lastEntryId": eid,
            "lac": eid - 1,
        }
    meta = node.app[STORAGE].ledger(LID)
    assert meta.replication == (3, 2, 2)
    described = await _json(await node.get(f"/api/v1/ledgers/{LID}"), 200)
    assert described["replication"] == {
        "ensembleSize": 3,
        "writeQuorumSize": 2,
        "ackQuorumSize": 2,
        "writerLac": 3,
        "writerLacLength": 40,
    }
    local = await _json(await node.post("/api/v1/ledgers", json={}), 201)
    assert local["replication"] is None
    read = await node.get(f"/api/v1/ledgers/{LID}/entries/3")
    assert read.status == 200 and await read.read() == b"e3"  # no "durable prefix" filter
    assert read.headers[protocol.LAC_HEADER] == "3"
    assert read.headers[protocol.NODE_ID_HEADER] == NODE
    missing = await node.get(f"/api/v1/ledgers/{LID}/entries/2")
    assert (await _json(missing, 404))["code"] == protocol.ENTRY_NOT_FOUND
    lac = await _json(await node.get(f"/api/v1/ledgers/{LID}/lac?replicated=1"), 200)
    assert lac == {"ledgerId": LID, "lac": 3, "lacLength": 40, "lastEntryId": 4, "fenced": False}
    # A plain LAC read (a long poll too) answers the writer's LAC at once.
    plain = await node.get(f"/api/v1/ledgers/{LID}/lac?after=3&timeoutMs=60000")
    assert await _json(plain, 200) == {"ledgerId": LID, "lac": 3}
    # The range read serves the ids held here, nothing in between.
    ranged = await node.get(f"/api/v1/ledgers/{LID}/entries?from=0&to=10")
    assert ranged.status == 200
    assert sorted(_frames(await ranged.read())) == [0, 1, 3, 4]
    # ... and so does the entry index (_above does not grow with the holes).
    assert not list(node.app[STORAGE]._lac.durable_above(LID))


def _frames(body: bytes) -> list[int]:
    return [eid for eid, _payload in protocol.decode_range(body)]


async def test_batch_and_range_bodies_and_idempotent_resends(node: Client) -> None:
    batch = protocol.encode_batch([b"a", b"b", b"c"])
    headers = {"Content-Type": protocol.BATCH_CONTENT_TYPE, **_replica(10, lac=9)}
    added = await _json(
        await node.post(f"/api/v1/ledgers/{LID}/entries", data=batch, headers=headers), 201
    )
    assert (added["firstEntryId"], added["lastEntryId"], added["lac"]) == (10, 12, 9)
    striped = protocol.encode_range([(14, b"x"), (17, b"y")])
    headers = {"Content-Type": protocol.RANGE_CONTENT_TYPE, **_replica(0, lac=12)}
    added = await _json(
        await node.post(f"/api/v1/ledgers/{LID}/entries", data=striped, headers=headers), 201
    )
    assert (added["firstEntryId"], added["lastEntryId"], added["lac"]) == (14, 17, 12)
    # The same bytes again: 201; other bytes at a held id: 409 entry_conflict.
    assert (await _add(node, LID, 11, b"b", lac=5)).status == 201
    assert (await _add(node, LID, 17, b"y", lac=5)).status == 201
    conflict = await _json(await _add(node, LID, 14, b"other"), 409)
    assert conflict["code"] == protocol.ENTRY_CONFLICT
    # The writer's LAC never goes down: an older add carries an older LAC.
    lac = await _json(await node.get(f"/api/v1/ledgers/{LID}/lac?replicated=1"), 200)
    assert lac["lac"] == 12 and lac["lastEntryId"] == 17
    for eid, payload in ((10, b"a"), (12, b"c"), (14, b"x"), (17, b"y")):
        read = await node.get(f"/api/v1/ledgers/{LID}/entries/{eid}")
        assert await read.read() == payload


async def test_plain_and_replica_adds_do_not_mix(node: Client) -> None:
    local = await _json(await node.post("/api/v1/ledgers", json={}), 201)
    refused = await _json(await _add(node, local["ledgerId"], 0, b"x"), 409)
    assert refused["code"] == protocol.NOT_REPLICATED
    assert (await _add(node, LID, 0, b"x")).status == 201
    plain = await node.post(f"/api/v1/ledgers/{LID}/entries", data=b"y")
    assert (await _json(plain, 409))["code"] == protocol.REPLICATED_LEDGER
    close = await node.post(f"/api/v1/ledgers/{LID}/close")
    assert (await _json(close, 409))["code"] == protocol.REPLICATED_LEDGER
    put = await node.put(f"/api/v1/ledgers/{LID}/entries/5", data=b"z")
    assert (await _json(put, 409))["code"] == protocol.REPLICATED_LEDGER


async def test_fencing_reads_and_recovery_adds(node: Client) -> None:
    assert (await _add(node, LID, 0, b"a")).status == 201
    assert (await _add(node, LID, 1, b"b", lac=0)).status == 201
    fenced = await _json(await node.get(f"/api/v1/ledgers/{LID}/lac?replicated=1&fence=1"), 200)
    assert fenced == {"ledgerId": LID, "lac": 0, "lacLength": 10, "lastEntryId": 1, "fenced": True}
    refused = await _json(await _add(node, LID, 2, b"c", lac=1), 409)
    assert refused["code"] == protocol.LEDGER_FENCED
    metrics = node.app[METRICS]
    assert metrics.replica_adds_refused_fenced._value.get() == 1
    assert metrics.replica_fences._value.get() == 1
    # A recovery's re-add passes the fence.
    assert (await _add(node, LID, 2, b"c", lac=1, recovery=True)).status == 201
    read = await node.get(f"/api/v1/ledgers/{LID}/entries/2?fence=1")
    assert read.status == 200 and await read.read() == b"c"
    assert metrics.replica_fences._value.get() == 2


async def test_fencing_an_unknown_ledger_creates_it_fenced(node: Client) -> None:
    other = LID + 1
    read = await node.get(f"/api/v1/ledgers/{LID}/entries/0?fence=1")
    assert (await _json(read, 404))["code"] == protocol.ENTRY_NOT_FOUND
    storage = node.app[STORAGE]
    assert storage.ledger(LID).replication == UNKNOWN_REPLICATION
    assert (await _json(await _add(node, LID, 0, b"late"), 409))["code"] == protocol.LEDGER_FENCED
    no_fence = await node.get(f"/api/v1/ledgers/{other}/lac?replicated=1")
    assert (await _json(no_fence, 404))["code"] == protocol.LEDGER_NOT_FOUND
    headers = {protocol.REPLICATED_HEADER: "3/3/2"}
    lac = await node.get(f"/api/v1/ledgers/{other}/lac?replicated=1&fence=1", headers=headers)
    assert await _json(lac, 200) == {
        "ledgerId": other,
        "lac": -1,
        "lacLength": 0,
        "lastEntryId": -1,
        "fenced": True,
    }
    assert storage.ledger(other).replication == (3, 3, 2)
    assert sorted(storage.replicated_ledgers()) == sorted(
        (m.ledger_id, m.created_ms) for m in (storage.ledger(LID), storage.ledger(other))
    )


async def test_wrong_node_on_both_lanes(node: Client) -> None:
    elsewhere = {protocol.EXPECT_NODE_HEADER: "bookie-b"}
    refused = await node.post(
        f"/api/v1/ledgers/{LID}/entries", data=b"x", headers={**_replica(0), **elsewhere}
    )
    assert (await _json(refused, 421))["code"] == protocol.WRONG_NODE
    assert (await node.get(f"/api/v1/ledgers/{LID}")).status == 404  # not created
    read = await node.get(f"/api/v1/ledgers/{LID}/lac?replicated=1", headers=elsewhere)
    assert (await _json(read, 421))["code"] == protocol.WRONG_NODE
    here = {protocol.EXPECT_NODE_HEADER: NODE}
    added = await node.post(
        f"/api/v1/ledgers/{LID}/entries", data=b"x", headers={**_replica(0), **here}
    )
    assert (await _json(added, 201))["lastEntryId"] == 0
    # Every reply names the node, the unknown route's 404 and the heartbeat too.
    for path in ("/heartbeat", "/no/such/route"):
        assert (await node.get(path)).headers[protocol.NODE_ID_HEADER] == NODE


async def test_bad_replica_headers(node: Client) -> None:
    """Malformed: 400. Well formed, but its numbers or companions break a rule: 422."""
    for bad, status, code in (
        ({protocol.REPLICATED_HEADER: "3-2-2"}, 400, "invalid_header"),
        ({protocol.REPLICATED_HEADER: "2/3/1"}, 422, "invalid_replication"),
        ({protocol.LAC_HEADER: "x"}, 400, "invalid_id"),
        ({protocol.ENTRY_ID_HEADER: "-3"}, 400, "invalid_id"),
        ({protocol.RECOVERY_ADD_HEADER: "yes"}, 400, "invalid_header"),
    ):
        response = await node.post(
            f"/api/v1/ledgers/{LID}/entries", data=b"x", headers={**_replica(0), **bad}
        )
        assert (await _json(response, status))["code"] == code, bad
    headers = _replica(0)
    del headers[protocol.LAC_HEADER]
    missing = await node.post(f"/api/v1/ledgers/{LID}/entries", data=b"x", headers=headers)
    assert (await _json(missing, 422))["code"] == "missing_header"
    query = await node.get(f"/api/v1/ledgers/{LID}/lac?replicated=1&fence=yes")
    assert (await _json(query, 400))["code"] == "invalid_query"
    flags = await node.get(f"/api/v1/ledgers/{LID}/lac?fence=1")
    assert (await _json(flags, 422))["code"] == "invalid_flags"
    # Nothing was created by the refused adds.
    assert (await node.get(f"/api/v1/ledgers/{LID}")).status == 404


async def test_quorums_past_what_the_index_holds_are_refused(node: Client) -> None:
    """E, Qw and Qa are 16 bits each in a replica's index: past that, 422 (it was a 500,
    the index's pack failing), on the add and on the fencing read that creates a ledger."""
    widest = 0xFFFF  # REPLICATION_FIXED's u16
    for text in ("999999/3/2", f"{widest + 1}/3/2", "70000/70000/70000"):
        bad = {protocol.REPLICATED_HEADER: text}
        add = await _add(node, LID, 0, b"x", **bad)
        fence = await node.get(f"/api/v1/ledgers/{LID}/lac?replicated=1&fence=1", headers=bad)
        for response in (add, fence):
            refused = await _json(response, 422)
            assert refused["code"] == "invalid_replication", text
            assert str(widest) in refused["message"]
    assert (await node.get(f"/api/v1/ledgers/{LID}")).status == 404  # nothing created
    added = await _add(node, LID, 0, b"x", **{protocol.REPLICATED_HEADER: f"{widest}/3/2"})
    assert (await _json(added, 201))["lastEntryId"] == 0
    assert node.app[STORAGE].ledger(LID).replication == (widest, 3, 2)


async def test_a_lac_past_the_adds_entries_is_refused(node: Client) -> None:
    """A writer confirms an entry once Qa replicas hold it: the LAC an add carries is never
    past the add's own entries. Such an add is refused (it was taken, and the replica then
    said lac 1000, lastEntryId 0); a recovery's copy, which carries a closed ledger's end,
    is not."""

    async def lac_view() -> Any:
        return await _json(await node.get(f"/api/v1/ledgers/{LID}/lac?replicated=1"), 200)

    async def post(body: bytes, content_type: str, headers: dict[str, str]) -> Any:
        headers = {"Content-Type": content_type, **headers}
        return await node.post(f"/api/v1/ledgers/{LID}/entries", data=body, headers=headers)

    # The fast lane (one raw entry), first add of the ledger: refused, nothing created.
    refused = await _json(await _add(node, LID, 0, b"a", lac=1000), 422)
    assert refused["code"] == protocol.INVALID_LAC and "1000" in refused["message"]
    assert (await node.get(f"/api/v1/ledgers/{LID}")).status == 404
    assert (await _add(node, LID, 0, b"a", lac=-1)).status == 201
    # A batch (aiohttp's route): its last entry bounds the LAC, which may name it.
    batch = protocol.encode_batch([b"b", b"c", b"d"])
    refused = await _json(await post(batch, protocol.BATCH_CONTENT_TYPE, _replica(1, lac=4)), 422)
    assert refused["code"] == protocol.INVALID_LAC
    assert await lac_view() == {
        "ledgerId": LID,
        "lac": -1,
        "lacLength": 0,
        "lastEntryId": 0,
        "fenced": False,
    }
    assert (await _add(node, LID, 1, b"b", lac=1000)).status == 422  # the fast lane, again
    # A range: its highest id bounds it.
    striped = protocol.encode_range([(5, b"x"), (8, b"y")])
    refused = await _json(await post(striped, protocol.RANGE_CONTENT_TYPE, _replica(5, lac=9)), 422)
    assert refused["code"] == protocol.INVALID_LAC
    assert (await lac_view())["lastEntryId"] == 0
    assert (await post(batch, protocol.BATCH_CONTENT_TYPE, _replica(1, lac=3))).status == 201
    assert (await lac_view())["lac"] == 3
    # A recovery's copy of a closed ledger's older fragment carries the ledger's end.
    copy = await _add(node, LID, 4, b"e", lac=40, recovery=True)
    assert (await _json(copy, 201))["lac"] == 40


async def test_reserved_ledger_ids_with_a_metadata_store(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    settings = make_settings(tmp_path / "data", id=NODE, metadata_url="etcd://127.0.0.1:1/x")
    client: Client = await aiohttp_client(build_app(settings))
    refused = await client.put(f"/api/v1/ledgers/{LEDGER_ID_BASE}", json={})
    assert (await _json(refused, 400))["code"] == protocol.RESERVED_LEDGER_ID
    assert (await client.put(f"/api/v1/ledgers/{LEDGER_ID_BASE - 1}", json={})).status == 201


class StoreGuard:
    """A guard over a tiny in-process "metadata store": the ledger ids it still holds, or
    unreachable. The route under test is the node's; this stands in for etcd only."""

    def __init__(self, held: set[int]) -> None:
        self.held = held
        self.reachable = True
        self.asked: list[int] = []

    async def confirm_deleted(self, ledger_id: int) -> bool:
        self.asked.append(ledger_id)
        if not self.reachable:
            raise StoreUnavailable("no endpoint answered")
        return ledger_id not in self.held


async def test_delete_of_a_replicated_ledger_without_a_metadata_store_is_refused(
    node: Client,
) -> None:
    assert (await _add(node, LID, 0, b"x")).status == 201
    refused = await node.delete(f"/api/v1/ledgers/{LID}")  # no guard installed
    assert (await _json(refused, 409))["code"] == protocol.REPLICATED_LEDGER
    assert (await node.get(f"/api/v1/ledgers/{LID}/entries/0")).status == 200


async def test_delete_of_a_replicated_ledger_asks_the_metadata_store(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    app = build_app(make_settings(tmp_path / "data", id=NODE))
    guard = StoreGuard({LID})
    app[REPLICA_GUARD] = guard
    node: Client = await aiohttp_client(app)
    assert (await _add(node, LID, 0, b"x")).status == 201
    path = f"/api/v1/ledgers/{LID}"
    assert (await _json(await node.delete(path), 409))["code"] == protocol.REPLICATED_LEDGER
    guard.reachable = False
    assert (await _json(await node.delete(path), 503))["code"] == "metadata_unavailable"
    assert (await node.get(f"{path}/entries/0")).status == 200  # nothing deleted
    guard.reachable = True
    guard.held.clear()
    assert (await node.delete(path)).status == 204
    gone = await node.get(f"{path}/entries/0")
    assert (await _json(gone, 404))["code"] == protocol.LEDGER_NOT_FOUND
    assert guard.asked == [LID, LID, LID]
    # A local ledger never asks.
    local = await _json(await node.post("/api/v1/ledgers", json={}), 201)
    assert (await node.delete(f"/api/v1/ledgers/{local['ledgerId']}")).status == 204
    assert guard.asked == [LID, LID, LID]


async def test_read_errors_are_not_absence(tmp_path: Path, aiohttp_client: Any) -> None:
    """An I/O error is 500 io_error and a flipped byte 500 corrupt_record; only a missing
    index key is 404 (BookKeeper #2908)."""
    for faults, code in (
        (["entrylog.read=eio"], "io_error"),
        (["index.get=eio"], "io_error"),
        ([], "corrupt_record"),
    ):
        data = tmp_path / code / str(len(faults) and faults[0])
        settings = make_settings(data, id=NODE, faults=faults)
        client: Client = await aiohttp_client(build_app(settings))
        assert (await _add(client, LID, 0, b"payload-0")).status == 201
        storage = client.app[STORAGE]
        await storage.checkpoint(force=True)
        if not faults:
            await asyncio.to_thread(_flip_payload, settings.ledgers_dir, b"payload-0")
        answer = await client.get(f"/api/v1/ledgers/{LID}/entries/0")
        assert (await _json(answer, 500))["code"] == code
        # The index has no key for entry 1: that one is absent.
        absent = await client.get(f"/api/v1/ledgers/{LID}/entries/1")
        if faults == ["index.get=eio"]:
            assert (await _json(absent, 500))["code"] == "io_error"
        else:
            assert (await _json(absent, 404))["code"] == protocol.ENTRY_NOT_FOUND
        await client.close()


def _flip_payload(ledgers_dir: Path, payload: bytes) -> None:
    """Flip a byte of ``payload`` where the entry log holds it."""
    for path in sorted(ledgers_dir.rglob("*.log")):
        at = path.read_bytes().find(payload)
        if at >= 0:
            flip_byte(path, at + 3)
            return
    raise AssertionError(f"{payload!r} is in no entry log under {ledgers_dir}")


async def _later(rng: random.Random, request: Awaitable[Any]) -> Any:
    await asyncio.sleep(rng.random() * 0.01)
    return await request


async def test_concurrent_first_adds_and_fencing_reads(node: Client) -> None:
    """Racing first adds all see one creation; adds racing fencing reads: none acknowledged
    after a fencing read answered entry_not_found for it."""
    firsts = await asyncio.gather(*(_add(node, LID, eid, b"%d" % eid) for eid in range(20)))
    assert all(r.status == 201 for r in firsts)
    seen: set[int] = set()
    rng = random.Random(31)
    for round_ in range(20):
        ledger = LID + 100 + round_
        adds = [
            asyncio.ensure_future(_later(rng, _add(node, ledger, eid, b"v%d" % eid)))
            for eid in range(8)
        ]
        reads = [
            asyncio.ensure_future(
                _later(rng, node.get(f"/api/v1/ledgers/{ledger}/entries/{eid}?fence=1"))
            )
            for eid in range(8)
        ]
        add_answers = await asyncio.gather(*adds)
        read_answers = await asyncio.gather(*reads)
        for eid, (added, read) in enumerate(zip(add_answers, read_answers, strict=True)):
            seen.add(read.status)
            if read.status == 404:
                assert (await read.json())["code"] == protocol.ENTRY_NOT_FOUND
                assert added.status == 409, (round_, eid)
            else:
                assert read.status == 200 and added.status == 201
                assert await read.read() == b"v%d" % eid
    assert seen == {200, 404}, seen  # both sides of the race ran


async def test_the_document_describes_the_replica_protocol(node: Client) -> None:
    document = await _json(await node.get("/openapi.json"), 200)
    assert set(document["components"]["schemas"]["ReplicaLac"]["required"]) == {
        "ledgerId",
        "lac",
        "lacLength",
        "lastEntryId",
        "fenced",
    }
    ledgers = document["paths"]["/api/v1/ledgers/{lid}/lac"]["get"]
    assert {p["name"] for p in ledgers["parameters"]} >= {"replicated", "fence"}
    assert {"409", "421", "422"} <= set(ledgers["responses"])
    read = document["paths"]["/api/v1/ledgers/{lid}/entries/{eid}"]["get"]
    assert {"fence"} <= {p["name"] for p in read["parameters"]}
    assert set(read["responses"]["200"]["headers"]) == {
        protocol.LAC_HEADER,
        protocol.NODE_ID_HEADER,
    }
    assert {"404", "409", "421", "500"} <= set(read["responses"])
    add = document["paths"]["/api/v1/ledgers/{lid}/entries"]["post"]
    assert protocol.RANGE_CONTENT_TYPE in add["requestBody"]["content"]
    for header in (protocol.REPLICATED_HEADER, protocol.LAC_HEADER, protocol.RECOVERY_ADD_HEADER):
        assert header in add["description"]
    assert "io_error" in read["responses"]["500"]["description"]


async def test_range_bodies_are_bounded_and_ascend(tmp_path: Path, aiohttp_client: Any) -> None:
    settings = make_settings(tmp_path / "data", id=NODE, max_entries_per_batch=4)
    node: Client = await aiohttp_client(build_app(settings))
    path = f"/api/v1/ledgers/{LID}/entries"
    headers = {"Content-Type": protocol.RANGE_CONTENT_TYPE, **_replica(0)}
    many = protocol.encode_range((eid, b"") for eid in range(5))
    too_many = await node.post(path, data=many, headers=headers)
    assert (await _json(too_many, 413))["code"] == "too_many_entries"
    backwards = protocol.encode_range([(5, b"a"), (2, b"b")])
    assert (await _json(await node.post(path, data=backwards, headers=headers), 400))[
        "code"
    ] == "invalid_argument"
    cut = protocol.encode_range([(1, b"abc")])[:-1]
    assert (await _json(await node.post(path, data=cut, headers=headers), 400))[
        "code"
    ] == "invalid_frame"
    assert (await node.get(f"/api/v1/ledgers/{LID}")).status == 404  # nothing created
