"""The ledger routes (docs/api.md, "Ledgers") over the real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import io
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from node.http.app import build_app
from node.storage.index import MAX_ID
from node.wire import decode_range, decode_stream_frames, encode_batch
from tests.harness.settings import make_settings

OCTET = {"Content-Type": "application/octet-stream"}
BATCH = {"Content-Type": "application/x-entry-batch"}
JSON = {"Content-Type": "application/json"}
TOKEN = "s3cret"
PROMPT_S = 2.0  # a long poll that has its answer returns within this (its timeout is 30 s)


async def _error(response: Any, status: int, code: str) -> None:
    assert response.status == status, await response.text()
    body = await response.json()
    assert body["code"] == code and isinstance(body["message"], str) and body["message"]


async def _ledger(client: Any, **body: Any) -> int:
    r = await client.post("/api/v1/ledgers", json=body or None)
    assert r.status == 201, await r.text()
    return int((await r.json())["ledgerId"])


async def test_create_with_node_and_client_ids(client: Any) -> None:
    r = await client.post("/api/v1/ledgers", json={"properties": {"team": "a"}})
    assert r.status == 201
    meta = await r.json()
    assert meta["state"] == "open" and meta["lac"] == -1 and meta["properties"] == {"team": "a"}
    assert isinstance(meta["createdTime"], int) and meta["closedTime"] is None
    r = await client.put("/api/v1/ledgers/1000")
    assert r.status == 201
    r = await client.put("/api/v1/ledgers/1000")  # idempotent
    assert r.status == 200
    r = await client.put("/api/v1/ledgers/1000", json={"properties": {"x": "y"}})
    await _error(r, 409, "ledger_exists")
    assert (await _ledger(client)) == 1001  # allocation skips past client ids
    r = await client.get("/api/v1/ledgers")
    assert [m["ledgerId"] for m in (await r.json())["ledgers"]] == [0, 1000, 1001]


async def test_add_read_range_and_lac(client: Any) -> None:
    lid = await _ledger(client)
    r = await client.put(f"/api/v1/ledgers/{lid}/entries/0", data=b"zero", headers=OCTET)
    assert r.status == 201 and await r.json() == {"ledgerId": lid, "entryId": 0, "lac": 0}
    r = await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"one", headers=OCTET)
    assert (await r.json())["entryId"] == 1
    r = await client.post(
        f"/api/v1/ledgers/{lid}/entries", data=encode_batch([b"two", b"", b"four"]), headers=BATCH
    )
    assert r.status == 201
    body = await r.json()
    assert (body["firstEntryId"], body["lastEntryId"], body["lac"]) == (2, 4, 4)
    assert "entryIds" not in body  # consecutive ids: the first and last name them all
    r = await client.get(f"/api/v1/ledgers/{lid}/entries/3")
    assert r.status == 200 and await r.read() == b""
    r = await client.get(f"/api/v1/ledgers/{lid}/entries?from=1&to=3")
    assert r.headers["Content-Type"] == "application/x-entry-range"
    assert list(decode_range(await r.read())) == [(1, b"one"), (2, b"two"), (3, b"")]
    r = await client.get(f"/api/v1/ledgers/{lid}/entries")
    assert [e for e, _ in decode_range(await r.read())] == [0, 1, 2, 3, 4]
    r = await client.get(f"/api/v1/ledgers/{lid}/lac")
    assert await r.json() == {"ledgerId": lid, "lac": 4}


async def test_range_is_sent_in_frames(client: Any) -> None:
    lid = await _ledger(client)
    payloads = [bytes([i % 256]) * 3000 for i in range(400)]  # > several write chunks
    body = io.BytesIO(encode_batch(payloads))  # large bodies go as a stream
    r = await client.post(f"/api/v1/ledgers/{lid}/entries", data=body, headers=BATCH)
    assert r.status == 201
    r = await client.get(f"/api/v1/ledgers/{lid}/entries?from=0")
    # Within max_read_reply_bytes: whole, so no X-Truncated (test_read_hardening.py cuts).
    assert "X-Truncated" not in r.headers and "X-Next-Entry-Id" not in r.headers
    assert r.headers["Content-Length"] == str(sum(12 + len(p) for p in payloads))
    frames = list(decode_range(await r.read()))
    assert frames == list(enumerate(payloads))


async def test_range_over_a_huge_hole_visits_only_what_exists(client: Any) -> None:
    # Schemathesis found it: a range read walked every id of the hole below an entry added
    # at a far id, on the event loop, and the node stopped answering (SIGTERM included).
    lid = await _ledger(client)
    far = 2**63 - 1
    for entry in (0, 1, 1000, far):
        r = await client.put(f"/api/v1/ledgers/{lid}/entries/{entry}", data=b"x", headers=OCTET)
        assert r.status == 201
    for query, ids in [
        ("", [0, 1, 1000, far]),
        ("?from=1", [1, 1000, far]),
        ("?from=2&to=1000", [1000]),
        (f"?from=1001&to={far - 1}", []),
        (f"?from={far}", [far]),
    ]:
        r = await asyncio.wait_for(client.get(f"/api/v1/ledgers/{lid}/entries{query}"), 10)
        assert [e for e, _ in decode_range(await r.read())] == ids, query
    r = await client.get(f"/api/v1/ledgers/{lid}/lac")
    assert await r.json() == {"ledgerId": lid, "lac": 1}


async def test_long_poll_lac_wakes_on_add(client: Any) -> None:
    lid = await _ledger(client)
    poll = asyncio.create_task(client.get(f"/api/v1/ledgers/{lid}/lac?after=-1&timeoutMs=5000"))
    await asyncio.sleep(0.05)
    assert not poll.done()
    await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"x", headers=OCTET)
    r = await asyncio.wait_for(poll, 5)
    assert await r.json() == {"ledgerId": lid, "lac": 0}
    r = await client.get(f"/api/v1/ledgers/{lid}/lac?after=0&timeoutMs=50")  # times out
    assert await r.json() == {"ledgerId": lid, "lac": 0}


@pytest.mark.parametrize("seal", ["close", "fence"])
async def test_long_poll_lac_wakes_on_close_and_fence(client: Any, seal: str) -> None:
    """No add will move the LAC of a closed or fenced ledger: a poll waiting for one is
    answered at once with the LAC, not at its timeout, and so is a poll begun after."""
    lid = await _ledger(client)
    await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"x", headers=OCTET)
    poll_url = f"/api/v1/ledgers/{lid}/lac?after=0&timeoutMs=30000"
    poll = asyncio.create_task(client.get(poll_url))
    await asyncio.sleep(0.1)
    assert not poll.done()
    started = time.monotonic()
    assert (await client.post(f"/api/v1/ledgers/{lid}/{seal}")).status == 200
    r = await asyncio.wait_for(poll, PROMPT_S)
    assert await r.json() == {"ledgerId": lid, "lac": 0}
    r = await asyncio.wait_for(client.get(poll_url), PROMPT_S)
    assert await r.json() == {"ledgerId": lid, "lac": 0}
    assert time.monotonic() - started < PROMPT_S


async def test_close_fence_delete(client: Any) -> None:
    lid = await _ledger(client)
    await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"x", headers=OCTET)
    r = await client.post(f"/api/v1/ledgers/{lid}/fence")
    assert r.status == 200 and (await r.json())["state"] == "fenced"
    r = await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"y", headers=OCTET)
    await _error(r, 409, "ledger_fenced")
    r = await client.post(f"/api/v1/ledgers/{lid}/close")
    meta = await r.json()
    assert meta["state"] == "closed" and meta["closedTime"] and meta["lac"] == 0
    r = await client.put(f"/api/v1/ledgers/{lid}/entries/1", data=b"y", headers=OCTET)
    await _error(r, 409, "ledger_closed")
    r = await client.delete(f"/api/v1/ledgers/{lid}")
    assert r.status == 204
    await _error(await client.get(f"/api/v1/ledgers/{lid}/entries/0"), 404, "ledger_not_found")
    await _error(await client.get(f"/api/v1/ledgers/{lid}"), 404, "ledger_not_found")
    await _error(await client.put(f"/api/v1/ledgers/{lid}"), 409, "ledger_exists")


async def test_write_token(client: Any) -> None:
    lid = await _ledger(client, writeToken="s3cret")
    r = await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"x", headers=OCTET)
    await _error(r, 403, "write_token_mismatch")
    r = await client.post(
        f"/api/v1/ledgers/{lid}/entries", data=b"x", headers={**OCTET, "X-Write-Token": "s3cret"}
    )
    assert r.status == 201


async def test_conflicts_and_idempotent_retries(client: Any) -> None:
    lid = await _ledger(client)
    url = f"/api/v1/ledgers/{lid}/entries/5"
    assert (await client.put(url, data=b"v", headers=OCTET)).status == 201
    assert (await client.put(url, data=b"v", headers=OCTET)).status == 201
    await _error(await client.put(url, data=b"w", headers=OCTET), 409, "entry_conflict")


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("get", "/api/v1/ledgers/42", 404, "ledger_not_found"),
        ("get", "/api/v1/ledgers/42/entries/0", 404, "ledger_not_found"),
        ("get", "/api/v1/ledgers/-1", 400, "invalid_id"),
        ("get", "/api/v1/ledgers/9223372036854775808", 400, "invalid_id"),
        ("get", "/api/v1/ledgers/99999999999999999999999", 400, "invalid_id"),
        ("get", "/api/v1/ledgers/1e3", 400, "invalid_id"),
        ("get", "/api/v1/ledgers/0/entries/x", 400, "invalid_id"),
        ("get", "/api/v1/ledgers/0/entries?from=abc", 400, "invalid_id"),
        ("get", "/api/v1/ledgers/0/lac?after=zz", 400, "invalid_id"),
        ("get", "/api/v1/nothing", 404, "not_found"),
        ("patch", "/api/v1/ledgers/0", 405, "method_not_allowed"),
    ],
)
async def test_bad_requests_get_json_errors(
    client: Any, method: str, path: str, status: int, code: str
) -> None:
    await _ledger(client)  # ledger 0 exists
    await _error(await getattr(client, method)(path), status, code)
    assert (await client.get("/api/v1/ledgers/0")).status == 200  # still serving


async def test_bad_bodies(client: Any) -> None:
    lid = await _ledger(client)
    base = f"/api/v1/ledgers/{lid}/entries"
    await _error(await client.get(f"{base}/0"), 404, "entry_not_found")
    await _error(await client.get(f"{base}?from=5&to=2"), 422, "invalid_range")
    torn = encode_batch([b"abc"]) + struct.pack(">I", 100) + b"short"
    await _error(await client.post(base, data=torn, headers=BATCH), 400, "invalid_frame")
    await _error(await client.post(base, data=b"\x00\x00", headers=BATCH), 400, "invalid_frame")
    r = await client.post(base, data=b"x", headers={"Content-Type": "text/plain"})
    await _error(r, 415, "unsupported_media_type")
    big = bytes((1 << 20) + 1)  # max_entry_size in tests is 1 MiB
    r = await client.post(base, data=io.BytesIO(big), headers=OCTET)
    await _error(r, 413, "entry_too_large")
    huge = bytes((8 << 20) + 1)  # max_request_size in tests is 8 MiB
    r = await client.post(base, data=io.BytesIO(huge), headers=OCTET)
    await _error(r, 413, "request_too_large")
    r = await client.post("/api/v1/ledgers", data=b"{nope", headers=JSON)
    await _error(r, 400, "invalid_json")
    r = await client.post("/api/v1/ledgers", json={"properties": {"a": 1}})
    await _error(r, 400, "invalid_body")
    r = await client.post("/api/v1/ledgers", json=["a"])
    await _error(r, 400, "invalid_body")
    r = await client.get(f"/api/v1/ledgers/{lid}")
    assert (await r.json())["entries"] == 0  # nothing was half-added


# --- a stream's ledgers belong to the stream API ---------------------------------------------


async def _stream_entries(client: Any, name: str) -> list[tuple[int, int, bytes]]:
    """Every entry of the stream, in order, as (ledger id, entry id, payload)."""
    r = await client.get(f"/api/v1/streams/{name}/entries")
    assert r.status == 200, await r.text()
    found = decode_stream_frames(await r.read())
    return [(position.ledger_id, position.entry_id, payload) for position, payload in found]


async def _stream_append(client: Any, name: str, payload: bytes) -> tuple[int, int]:
    r = await client.post(f"/api/v1/streams/{name}/entries", data=payload, headers=OCTET)
    assert r.status == 201, await r.text()
    ledger, entry = str((await r.json())["position"]).split(":")
    return int(ledger), int(entry)


STREAM_REFUSED = [
    ("put", "/entries/2", {"data": b"foreign", "headers": OCTET}),  # the next id
    ("put", "/entries/0", {"data": b"a", "headers": OCTET}),  # a retry of a stream entry
    ("put", "/entries/100", {"data": b"foreign", "headers": OCTET}),  # past a hole
    ("post", "/entries", {"data": b"foreign", "headers": OCTET}),
    ("post", "/entries", {"data": encode_batch([b"f1", b"f2"]), "headers": BATCH}),
    ("post", "/fence", {}),
    ("post", "/close", {}),
    ("delete", "", {}),
]


@pytest.mark.parametrize(("method", "suffix", "request_args"), STREAM_REFUSED)
async def test_the_ledger_api_refuses_to_change_a_streams_ledger(
    tmp_path: Path, aiohttp_client: Any, method: str, suffix: str, request_args: dict[str, Any]
) -> None:
    settings = make_settings(tmp_path / "d")
    client = await aiohttp_client(build_app(settings))
    assert (await client.put("/api/v1/streams/orders", json={})).status == 201
    lid, _ = await _stream_append(client, "orders", b"a")
    await _stream_append(client, "orders", b"b")
    url = f"/api/v1/ledgers/{lid}{suffix}"
    r = await getattr(client, method)(url, **request_args)
    await _error(r, 409, "owned_by_stream")
    message = (await r.json())["message"]
    assert "orders" in message and "stream API" in message
    # Reads and metadata stay open to the ledger API.
    meta = await (await client.get(f"/api/v1/ledgers/{lid}")).json()
    assert meta["state"] == "open" and meta["lastEntryId"] == 1 and meta["entries"] == 2
    assert meta["properties"] == {"stream": "orders"}
    assert await (await client.get(f"/api/v1/ledgers/{lid}/entries/1")).read() == b"b"
    r = await client.get(f"/api/v1/ledgers/{lid}/entries")
    assert list(decode_range(await r.read())) == [(0, b"a"), (1, b"b")]
    # The stream goes on, on the same ledger, and so it does after a restart.
    assert await _stream_append(client, "orders", b"c") == (lid, 2)
    await client.close()
    client = await aiohttp_client(build_app(settings))
    assert await _stream_append(client, "orders", b"d") == (lid, 3)
    assert await _stream_entries(client, "orders") == [
        (lid, 0, b"a"), (lid, 1, b"b"), (lid, 2, b"c"), (lid, 3, b"d"),
    ]  # fmt: skip


@pytest.mark.parametrize("method", ["post", "put"])
async def test_a_client_cannot_create_a_ledger_claiming_a_stream(client: Any, method: str) -> None:
    url = "/api/v1/ledgers" if method == "post" else "/api/v1/ledgers/77"
    r = await getattr(client, method)(url, json={"properties": {"stream": "orders", "x": "y"}})
    await _error(r, 400, "reserved_property")
    assert "stream" in (await r.json())["message"]
    r = await client.get("/api/v1/ledgers")
    assert (await r.json())["ledgers"] == []  # nothing was created
    r = await client.post("/api/v1/ledgers", json={"properties": {"streams": "x"}})
    assert r.status == 201  # only the exact key is reserved


# --- the last entry id -----------------------------------------------------------------------


async def test_appends_past_the_last_entry_id_are_refused_whole(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    settings = make_settings(tmp_path / "d")
    client = await aiohttp_client(build_app(settings))
    lid = await _ledger(client)
    base = f"/api/v1/ledgers/{lid}/entries"
    r = await client.put(f"{base}/{MAX_ID - 1}", data=b"a", headers=OCTET)
    assert r.status == 201
    # Its first entry would fit, its second would not: none of it is added.
    r = await client.post(base, data=encode_batch([b"b", b"c"]), headers=BATCH)
    await _error(r, 409, "ledger_full")
    await _error(await client.get(f"{base}/{MAX_ID}"), 404, "entry_not_found")
    meta = await (await client.get(f"/api/v1/ledgers/{lid}")).json()
    assert (meta["entries"], meta["bytes"], meta["lastEntryId"]) == (1, 1, MAX_ID - 1)
    await client.close()

    client = await aiohttp_client(build_app(settings))  # nothing of it was journaled either
    await _error(await client.get(f"{base}/{MAX_ID}"), 404, "entry_not_found")
    meta = await (await client.get(f"/api/v1/ledgers/{lid}")).json()
    assert (meta["entries"], meta["bytes"], meta["lastEntryId"]) == (1, 1, MAX_ID - 1)
    r = await client.put(f"{base}/{MAX_ID}", data=b"z", headers=OCTET)
    assert r.status == 201, await r.text()
    # The ledger has no id left to append at: single and batch appends are refused.
    await _error(await client.post(base, data=b"y", headers=OCTET), 409, "ledger_full")
    r = await client.post(base, data=encode_batch([b"y"]), headers=BATCH)
    await _error(r, 409, "ledger_full")
    await client.close()

    client = await aiohttp_client(build_app(settings))
    meta = await (await client.get(f"/api/v1/ledgers/{lid}")).json()
    assert (meta["entries"], meta["bytes"], meta["lastEntryId"]) == (2, 2, MAX_ID)
    r = await client.get(f"{base}?from={MAX_ID - 1}")
    assert list(decode_range(await r.read())) == [(MAX_ID - 1, b"a"), (MAX_ID, b"z")]


# --- the write token guards fence, close and delete as it guards adds ------------------------


@pytest.mark.parametrize(
    ("method", "suffix", "status", "state"),
    [
        ("post", "/fence", 200, "fenced"),
        ("post", "/close", 200, "closed"),
        ("delete", "", 204, None),
    ],
)
async def test_fence_close_and_delete_need_the_write_token(
    client: Any, method: str, suffix: str, status: int, state: str | None
) -> None:
    lid = await _ledger(client, writeToken=TOKEN)
    r = await client.post(
        f"/api/v1/ledgers/{lid}/entries", data=b"x", headers={**OCTET, "X-Write-Token": TOKEN}
    )
    assert r.status == 201
    url = f"/api/v1/ledgers/{lid}{suffix}"
    for headers in ({}, {"X-Write-Token": "wrong"}, {"X-Write-Token": ""}):
        await _error(
            await getattr(client, method)(url, headers=headers), 403, "write_token_mismatch"
        )
        meta = await (await client.get(f"/api/v1/ledgers/{lid}")).json()
        assert meta["state"] == "open"  # untouched
        assert await (await client.get(f"/api/v1/ledgers/{lid}/entries/0")).read() == b"x"
    r = await getattr(client, method)(url, headers={"X-Write-Token": TOKEN})
    assert r.status == status, await r.text()
    r = await client.get(f"/api/v1/ledgers/{lid}")
    if state is None:
        await _error(r, 404, "ledger_not_found")
    else:
        assert (await r.json())["state"] == state
