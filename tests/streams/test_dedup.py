"""Message deduplication on one node (node/streams/dedup.py), in process over loopback HTTP
(the fast lane answers these appends, as it does in production): a producer's retried
append lands once and is answered with where it went the first time; bad headers are 400s
with stable codes; the table survives a restart (snapshot + the entries after it); readers
get exactly the bytes appended."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from jsonschema import Draft202012Validator

from node.client.producer import ProducerRefused, StreamProducer
from node.http.app import build_app
from node.streams.dedup import (
    RECENT_RUNS,
    BadEnvelope,
    Table,
    envelope_head,
    enveloped,
    open_envelope,
)
from node.streams.model import Position
from node.wire import BATCH_CONTENT_TYPE, decode_stream_frames, encode_batch
from tests.harness.metrics import parse_samples
from tests.harness.settings import make_settings

Client = TestClient[Any, Any]
Start = Callable[..., Awaitable[Client]]
STREAM = "orders"
DEDUP = {"deduplication": True, "minLedgerRolloverTimeMinutes": 0}
OCTET = "application/octet-stream"
SLOW_FSYNC_S = 0.5  # each WAL fsync: an append stays in flight that long
POLL_S = 0.01


@pytest.fixture
async def start(aiohttp_client: Any, tmp_path: Path) -> AsyncIterator[Start]:
    """A node on tmp_path/d with these settings; a second call after ``client.close()`` is
    the node started again on the same data."""

    async def make(**overrides: Any) -> Client:
        app = build_app(make_settings(tmp_path / "d", **overrides))
        return await aiohttp_client(app)  # type: ignore[no-any-return]

    yield make


async def _stream(client: Client, name: str = STREAM, **policies: Any) -> None:
    answer = await client.put(f"/api/v1/streams/{name}", json={**DEDUP, **policies})
    assert answer.status == 201, await answer.text()


async def _append(
    client: Client,
    body: bytes | list[bytes],
    producer: str | None = "p1",
    seq: int | str | None = 0,
    name: str = STREAM,
) -> tuple[int, dict[str, Any], str | None]:
    headers = {"Content-Type": OCTET}
    data = body
    if isinstance(body, list):
        headers["Content-Type"], data = BATCH_CONTENT_TYPE, encode_batch(body)
    if producer is not None:
        headers["X-Producer-Id"] = producer
    if seq is not None:
        headers["X-Sequence-Id"] = str(seq)
    answer = await client.post(f"/api/v1/streams/{name}/entries", data=data, headers=headers)
    return answer.status, await answer.json(), answer.headers.get("X-Duplicate")


async def _documented(client: Client, status: int, answers: list[Any]) -> None:
    """Each of ``answers`` matches the node's OpenAPI document for a stream append's
    ``status``."""
    document = await (await client.get("/openapi.json")).json()
    post = document["paths"]["/api/v1/streams/{name}/entries"]["post"]
    schema = post["responses"][str(status)]["content"]["application/json"]["schema"]
    validator = Draft202012Validator({**schema, "components": document["components"]})
    for answer in answers:
        validator.validate(answer)


async def _read(client: Client, name: str = STREAM) -> list[tuple[str, bytes]]:
    answer = await client.get(f"/api/v1/streams/{name}/entries?limit=1000")
    assert answer.status == 200, await answer.text()
    return [(str(p), payload) for p, payload in decode_stream_frames(await answer.read())]


def test_the_entry_header_round_trips_and_a_foreign_entry_is_refused() -> None:
    for producer, seq in [("p", 0), ("a" * 255, (1 << 63) - 1), (None, -1)]:
        head = envelope_head(producer, max(seq, 0))
        assert open_envelope(head + b"payload") == (producer, seq, b"payload")
    assert open_envelope(envelope_head("p", 7)) == ("p", 7, b"")
    stored = enveloped([b"a", b"b"], "p", 5) + enveloped([b"c"], None, 0)
    assert list(map(open_envelope, stored)) == [("p", 5, b"a"), ("p", 6, b"b"), (None, -1, b"c")]
    assert stored[0] == envelope_head("p", 5) + b"a"
    with pytest.raises(BadEnvelope):
        open_envelope(b"\x02\x00x")  # another version
    with pytest.raises(BadEnvelope):
        open_envelope(envelope_head("producer", 1)[:-3])  # cut short


def test_a_snapshot_round_trips_and_idle_producers_are_forgotten() -> None:
    table = Table()
    table.record("a", 0, Position(3, 0), 2, now=1_000)
    table.record("b", 5, Position(3, 2), 1, now=9_000)
    table.record(None, 0, Position(3, 3), 1, now=9_000)
    again = Table.decode(table.encode(10_000))
    assert again.producers == table.producers and again.through == Position(3, 3)
    assert again.check("a", 1, 1).positions == [Position(3, 1)]
    assert again.expire(now_ms=9_500, idle_ms=5_000) == 1
    assert set(again.producers) == {"b"}


def test_each_producer_keeps_the_positions_of_its_last_runs_of_appends() -> None:
    """A producer with several appends out whose answers were all lost learns where each
    one is (Kafka keeps five batches): up to RECENT_RUNS runs, a run being appends of
    consecutive ids stored one after the other."""
    table = Table()
    table.record("p", 0, Position(1, 0), 2, now=0)  # 0..1 at 1:0..1
    table.record("p", 2, Position(1, 2), 1, now=0)  # follows: the same run, 0..2
    table.record("q", 0, Position(1, 3), 1, now=0)
    for n in range(RECENT_RUNS):  # p's ids 3.., each after one of q's: a run apiece
        table.record("p", 3 + n, Position(1, 4 + 2 * n), 1, now=0)
        table.record("q", 1 + n, Position(1, 5 + 2 * n), 1, now=0)
    assert len(table.producers["p"].runs) == RECENT_RUNS
    assert table.check("p", 3, 1).positions == [Position(1, 4)]  # the oldest run kept
    assert table.check("p", 2, 1).positions == []  # its run went: a duplicate, no position
    assert table.check("p", 7, 1).positions == [Position(1, 12)]
    assert table.last("p") == (7, Position(1, 12))
    again = Table.decode(table.encode(1))
    assert again.producers == table.producers
    # A gap: the ids it skipped were never stored anywhere.
    table.record("p", 20, Position(2, 0), 2, now=0)
    assert table.check("p", 10, 1).positions == []
    assert table.check("p", 21, 1).positions == [Position(2, 1)]
    assert table.check("p", 6, 2).positions == []  # no one append: 6 and 7 are two runs


def test_a_snapshot_of_the_first_version_is_read() -> None:
    """Version 1 kept one run per producer: [highest, first, "ledger:entry", seen_ms]."""
    v1 = b'{"v": 1, "through": "4:9", "at": 5, "producers": {"p": [12, 10, "4:7", 3]}}'
    table = Table.decode(v1)
    assert (table.through, table.snapshot_ms) == (Position(4, 9), 5)
    assert table.check("p", 11, 2).positions == [Position(4, 8), Position(4, 9)]
    assert table.check("p", 9, 1).positions == []
    assert table.last("p") == (12, Position(4, 9))


async def test_a_retried_append_lands_once_and_is_answered_with_its_first_position(
    start: Start,
) -> None:
    client = await start()
    await _stream(client)
    status, first, duplicate = await _append(client, b"one", "p1", 7)
    assert (status, duplicate) == (201, None), first
    for _ in range(2):
        status, again, duplicate = await _append(client, b"one", "p1", 7)
        assert (status, again, duplicate) == (200, first, "true")
    # A batch takes consecutive ids from its first; its retry names the same two positions.
    status, batch, _ = await _append(client, [b"two", b"three"], "p1", 8)
    assert status == 201, batch
    status, again, duplicate = await _append(client, [b"two", b"three"], "p1", 8)
    assert (status, again, duplicate) == (200, batch, "true")
    # One id of the batch alone: where that entry went.
    status, again, duplicate = await _append(client, b"three", "p1", 9)
    assert (status, again["position"], duplicate) == (200, batch["lastPosition"], "true")
    # A gap is accepted (Pulsar); an id it skipped is a duplicate with no position, and so is
    # one before the producer's first; the appends before the gap keep theirs.
    assert (await _append(client, b"four", "p1", 20))[0] == 201
    for skipped in (3, 15):
        status, again, duplicate = await _append(client, b"zero", "p1", skipped)
        assert (status, again, duplicate) == (200, {"position": None}, "true")
    status, again, duplicate = await _append(client, b"one", "p1", 7)
    assert (status, again, duplicate) == (200, first, "true")
    # The answers are the OpenAPI document's.
    status, batch_null, _ = await _append(client, [b"a", b"b"], "p1", 4)
    assert batch_null == {"firstPosition": None, "lastPosition": None}
    await _documented(client, 200, [again, {"position": None}, batch, batch_null])
    # Another producer has its own ids; appends without headers go on as before.
    assert (await _append(client, b"other", "p2", 7))[0] == 201
    assert (await _append(client, b"plain", None, None))[0] == 201
    read = await _read(client)
    assert [payload for _, payload in read] == [b"one", b"two", b"three", b"four", b"other",
                                                b"plain"]  # fmt: skip
    assert read[0][0] == first["position"]
    assert (read[1][0], read[2][0]) == (batch["firstPosition"], batch["lastPosition"])
    metrics = await (await client.get("/metrics")).text()
    assert 'storage_node_stream_dedup_duplicates_total{stream="orders"} 8.0' in metrics
    assert 'storage_node_stream_dedup_producers{stream="orders"} 2.0' in metrics
    page = await (await client.get("/api/v1/status/streams")).json()
    shown = page["streams"][0]["deduplication"]
    assert (shown["duplicates"], shown["producers"]) == (8, 2), shown


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({"X-Producer-Id": "p"}, "invalid_producer_headers"),
        ({"X-Sequence-Id": "1"}, "invalid_producer_headers"),
        ({"X-Producer-Id": "bad/name", "X-Sequence-Id": "1"}, "invalid_producer_id"),
        ({"X-Producer-Id": "a" * 256, "X-Sequence-Id": "1"}, "invalid_producer_id"),
        ({"X-Producer-Id": "p", "X-Sequence-Id": "-1"}, "invalid_sequence_id"),
        ({"X-Producer-Id": "p", "X-Sequence-Id": "1.5"}, "invalid_sequence_id"),
        ({"X-Producer-Id": "p", "X-Sequence-Id": str(1 << 63)}, "invalid_sequence_id"),
        ({"X-Producer-Id": "p", "X-Sequence-Id": "٣"}, "invalid_sequence_id"),
    ],
)
async def test_bad_producer_headers_are_refused_with_a_stable_code(
    start: Start, headers: dict[str, str], code: str
) -> None:
    client = await start()
    await _stream(client)
    answer = await client.post(
        f"/api/v1/streams/{STREAM}/entries", data=b"x", headers={"Content-Type": OCTET, **headers}
    )
    assert answer.status == 400 and (await answer.json())["code"] == code
    assert await _read(client) == []


async def test_a_batch_past_the_last_sequence_id_is_refused(start: Start) -> None:
    client = await start()
    await _stream(client)
    status, body, _ = await _append(client, [b"a", b"b"], "p", (1 << 63) - 1)
    assert (status, body["code"]) == (400, "invalid_sequence_id")


async def test_producer_headers_on_a_stream_without_deduplication_are_refused(
    start: Start,
) -> None:
    """Not ignored (as Pulsar does): the client would believe it gets exactly-once."""
    client = await start()
    await _stream(client, deduplication=False)
    status, body, _ = await _append(client, b"x", "p", 1)
    assert (status, body["code"]) == (409, "deduplication_off")
    assert (await _append(client, b"y", None, None))[0] == 201


async def test_the_same_append_sent_twice_at_once_is_written_once(start: Start) -> None:
    """Two clients send the same (producer, sequence id) at the same time, repeatedly: the
    second waits for the first and answers its position."""
    client = await start()
    await _stream(client)
    for seq in range(20):
        answers = await asyncio.gather(
            _append(client, f"e{seq}".encode(), "p", seq),
            _append(client, f"e{seq}".encode(), "p", seq),
        )
        assert sorted(a[0] for a in answers) == [200, 201], answers
        assert answers[0][1] == answers[1][1]
    read = await _read(client)
    assert [payload for _, payload in read] == [f"e{seq}".encode() for seq in range(20)]


async def test_a_batch_overlapping_stored_ids_is_refused(start: Start) -> None:
    client = await start()
    await _stream(client)
    assert (await _append(client, [b"a", b"b"], "p", 0))[0] == 201
    status, body, _ = await _append(client, [b"b", b"c"], "p", 1)
    assert (status, body["code"]) == (409, "sequence_overlap")


async def test_producers_past_the_cap_are_refused(start: Start) -> None:
    client = await start(stream_dedup_max_producers=2)
    await _stream(client)
    assert (await _append(client, b"a", "p1", 0))[0] == 201
    assert (await _append(client, b"b", "p2", 0))[0] == 201
    status, body, _ = await _append(client, b"c", "p3", 0)
    assert (status, body["code"]) == (429, "too_many_producers"), body
    assert (await _append(client, b"d", "p1", 1))[0] == 201  # known ones go on


@pytest.mark.parametrize("interval", [1000, 3])
async def test_the_table_survives_a_restart(start: Start, interval: int) -> None:
    """Restarted on its data: the retries of every append before the restart are answered
    as duplicates at their first positions (rebuilt from the entries alone, or from a
    snapshot and the entries after it)."""
    client = await start(stream_dedup_snapshot_interval_entries=interval)
    await _stream(client, maxEntriesPerLedger=4)
    first: dict[int, dict[str, Any]] = {}
    for seq in range(0, 20, 2):
        status, first[seq], _ = await _append(client, [b"%d" % seq, b"%d" % (seq + 1)], "p", seq)
        assert status == 201
        await _append(client, b"plain", None, None)
    await client.close()
    client = await start(stream_dedup_snapshot_interval_entries=interval)
    for seq in range(0, 20, 2):
        status, again, duplicate = await _append(client, [b"%d" % seq, b"%d" % (seq + 1)], "p", seq)
        if seq == 18:  # the last append: its positions are kept
            assert (status, again, duplicate) == (200, first[seq], "true")
        else:
            assert (status, duplicate) == (200, "true")
    assert (await _append(client, b"20", "p", 20))[0] == 201
    read = await _read(client)
    assert len(read) == 31 and read[-1][1] == b"20"


async def test_turning_deduplication_on_takes_a_new_ledger_and_reads_stay_exact(
    start: Start,
) -> None:
    client = await start()
    await _stream(client, deduplication=False)
    assert (await _append(client, b"before", None, None))[0] == 201
    answer = await client.put(f"/api/v1/streams/{STREAM}", json={**DEDUP, "deduplication": True})
    assert answer.status == 200 and (await answer.json())["policies"]["deduplication"] is True
    status, body, _ = await _append(client, b"after", "p", 0)
    assert status == 201, body
    assert (await _append(client, b"plain", None, None))[0] == 201
    read = await _read(client)
    assert [payload for _, payload in read] == [b"before", b"after", b"plain"]
    assert read[0][0].split(":")[0] != read[1][0].split(":")[0]  # another ledger
    answer = await client.put(f"/api/v1/streams/{STREAM}", json={"deduplication": "yes"})
    assert answer.status == 400 and (await answer.json())["code"] == "invalid_policy"


async def test_an_append_whose_answer_was_lost_is_retried_and_lands_once(start: Start) -> None:
    """Every WAL fsync takes half a second: the client gives up on its append before the
    answer (an unknown outcome) and sends it again with the same ids, while the first is
    still in flight and after it landed: both retries are answered with its position."""
    client = await start(faults=["journal.fsync=delay:0.5"])
    await _stream(client)
    assert (await _append(client, b"first", None, None))[0] == 201  # its ledger is made
    headers = {"Content-Type": OCTET, "X-Producer-Id": "p", "X-Sequence-Id": "0"}
    url = f"/api/v1/streams/{STREAM}/entries"
    with pytest.raises(TimeoutError):
        await client.post(url, data=b"once", headers=headers, timeout=aiohttp.ClientTimeout(0.1))
    answers = []
    for _ in range(2):
        answer = await client.post(url, data=b"once", headers=headers)
        answers.append((answer.status, await answer.json(), answer.headers.get("X-Duplicate")))
    assert answers[0] == answers[1] and answers[0][0] == 200 and answers[0][2] == "true", answers
    assert (await _read(client))[1:] == [(answers[0][1]["position"], b"once")]


async def test_a_producer_whose_ledgers_retention_deleted_is_still_known(start: Start) -> None:
    """Producer q's only append is in a ledger retention deletes; after a restart its retry
    is still a duplicate: the trim wrote the table's snapshot in the batch that dropped the
    ledger (its entries can tell nothing any more)."""
    client = await start()
    await _stream(client, maxEntriesPerLedger=2, retentionTimeInMinutes=0)
    status, first, _ = await _append(client, b"q0", "q", 0)
    assert status == 201
    for seq in range(6):
        assert (await _append(client, b"p%d" % seq, "p", seq))[0] == 201
    cursor = f"/api/v1/streams/{STREAM}/cursors/c"
    assert (await client.put(cursor, json={"start": "earliest"})).status == 201
    last = (await _read(client))[-1][0]
    assert (await client.post(f"{cursor}/ack", json={"position": last})).status == 200
    answer = await client.post("/api/v1/retention/run")
    assert answer.status == 200
    dropped = {d["ledgerId"] for d in (await answer.json())["streams"][STREAM]}
    assert int(first["position"].split(":")[0]) in dropped
    await client.close()
    client = await start()
    status, again, duplicate = await _append(client, b"q0", "q", 0)
    assert (status, again, duplicate) == (200, first, "true")
    assert b"q0" not in [payload for _, payload in await _read(client)]


async def test_the_client_producer_retries_until_it_has_a_position(start: Start) -> None:
    """node/client/producer.py: its first attempts time out (slow WAL fsyncs) or find no node
    (a closed port first in its list); it sends the same ids again until a node answers, and
    the stream holds each entry once."""
    client = await start(faults=["journal.fsync=delay:0.3"])
    await _stream(client)
    assert (await _append(client, b"first", None, None))[0] == 201  # its ledger is made
    served = f"http://{client.host}:{client.port}"
    closed = "http://127.0.0.1:9"  # discard: nobody listens
    async with StreamProducer([closed, served], STREAM, "p", timeout_s=0.1) as producer:
        one = await producer.append(b"one")
        batch = await producer.append_batch(encode_batch([b"two", b"three"]), 2)
        assert (one.duplicate, batch.duplicate) == (True, True), (one, batch)
        assert producer.next_sequence == 3 and producer.retries >= 4
    read = await _read(client)
    assert [payload for _, payload in read] == [b"first", b"one", b"two", b"three"]
    assert (one.position, batch.first, batch.last) == (read[1][0], read[2][0], read[3][0])
    async with StreamProducer(served, "nostream", "p") as producer:
        with pytest.raises(ProducerRefused) as refused:
            await producer.append(b"x")
    assert refused.value.code == "stream_not_found"


async def test_a_stream_made_again_under_a_deleted_ones_name_knows_no_producer(
    start: Start,
) -> None:
    client = await start(stream_dedup_snapshot_interval_entries=1)  # a snapshot at once
    await _stream(client)
    assert (await _append(client, b"old", "p", 0))[0] == 201
    assert (await client.delete(f"/api/v1/streams/{STREAM}")).status == 204
    await _stream(client)
    status, _, duplicate = await _append(client, b"new", "p", 0)
    assert (status, duplicate) == (201, None)
    assert [payload for _, payload in await _read(client)] == [b"new"]


async def _last(client: Client, producer: str, name: str = STREAM) -> tuple[int, dict[str, Any]]:
    answer = await client.get(f"/api/v1/streams/{name}/producers/{producer}")
    return answer.status, await answer.json()


async def test_a_producers_last_sequence_id_is_where_it_resumes(start: Start) -> None:
    """GET .../producers/{id} (Pulsar's getLastSequenceId): the highest id stored and its
    entry's position, also after a restart; a stable 404 for a producer never seen; the
    client producer resumes after it."""
    client = await start()
    await _stream(client)
    status, body = await _last(client, "p")
    assert (status, body["code"]) == (404, "producer_not_found")
    assert (await _append(client, b"zero", "p", 0))[0] == 201
    status, batch, _ = await _append(client, [b"five", b"six"], "p", 5)
    assert status == 201
    assert await _last(client, "p") == (
        200,
        {"producerId": "p", "lastSequenceId": 6, "position": batch["lastPosition"]},
    )
    assert (await _last(client, "bad id!"))[1]["code"] == "invalid_producer_id"
    assert (await _last(client, "p", "nostream"))[1]["code"] == "stream_not_found"
    await _stream(client, "plain", deduplication=False)
    assert (await _last(client, "p", "plain"))[1]["code"] == "deduplication_off"
    await client.close()
    client = await start()
    assert (await _last(client, "p"))[1]["lastSequenceId"] == 6  # rebuilt from the entries
    served = f"http://{client.host}:{client.port}"
    async with StreamProducer(served, STREAM, "p", resume=True) as producer:
        assert producer.next_sequence == 7
        appended = await producer.append(b"seven")
    assert (appended.sequence, appended.duplicate) == (7, False)
    async with StreamProducer(served, STREAM, "new", next_sequence=3, resume=True) as producer:
        assert producer.next_sequence == 3  # unknown to the stream: as given
    assert [p for _, p in await _read(client)] == [b"zero", b"five", b"six", b"seven"]


async def test_the_last_sequence_id_waits_for_the_producers_append_in_flight(
    start: Start,
) -> None:
    """Asked while an append of the producer is in flight (slow WAL fsyncs), the answer is
    that append's id once it landed, never the one before: a producer resuming after that
    would send new entries under an id that lands a moment later."""
    client = await start(faults=[f"journal.fsync=delay:{SLOW_FSYNC_S}"])
    await _stream(client)
    assert (await _append(client, b"zero", "p", 0))[0] == 201
    sent = asyncio.create_task(_append(client, b"one", "p", 1))
    for _ in range(int(SLOW_FSYNC_S / POLL_S)):
        if await _body_bytes_held(client):  # the node has the append
            break
        await asyncio.sleep(POLL_S)
    status, last = await _last(client, "p")
    assert sent.done()
    _, one, _ = await sent
    assert (status, last["lastSequenceId"], last["position"]) == (200, 1, one["position"])


async def _body_bytes_held(client: Client) -> float:
    samples = parse_samples(await (await client.get("/metrics")).text())
    return samples[("storage_node_http_request_body_bytes_in_flight", ())]
