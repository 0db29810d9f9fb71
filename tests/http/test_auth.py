"""The admin token guards every state change under /api/v1/; the write token guards adds."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from node.client import protocol
from node.client.metadata.store import LEDGER_ID_BASE
from node.http.app import build_app
from node.http.fastlane import SERVER_HEADER as FAST_LANE_SERVER
from tests.harness.settings import make_settings
from tests.http.test_fastlane import Conn

TOKEN = "s3cr3t-admin"


@pytest.fixture
async def guarded(tmp_path: Path, aiohttp_client: Any) -> Any:
    return await aiohttp_client(build_app(make_settings(tmp_path / "d", admin_token=TOKEN)))


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("post", "/api/v1/ledgers"),
        ("put", "/api/v1/ledgers/5"),
        ("delete", "/api/v1/ledgers/5"),
        ("post", "/api/v1/ledgers/5/entries"),
        ("put", "/api/v1/ledgers/5/entries/0"),
        ("post", "/api/v1/ledgers/5/fence"),
        ("put", "/api/v1/bookie/state/readonly"),
    ],
)
async def test_state_changes_need_the_bearer_token(guarded: Any, method: str, path: str) -> None:
    r = await getattr(guarded, method)(path)
    assert r.status == 401 and (await r.json())["code"] == "unauthorized"
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    r = await getattr(guarded, method)(path, headers={"Authorization": "Bearer wrong"})
    assert r.status == 403 and (await r.json())["code"] == "forbidden"
    r = await getattr(guarded, method)(path, headers={"Authorization": f"Basic {TOKEN}"})
    assert r.status == 401


async def test_the_right_token_passes_and_reads_need_none(guarded: Any) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = await guarded.put("/api/v1/ledgers/5", headers=auth)
    assert r.status == 201
    r = await guarded.put(
        "/api/v1/ledgers/5/entries/0",
        data=b"x",
        headers={**auth, "Content-Type": "application/octet-stream"},
    )
    assert r.status == 201
    assert (await guarded.get("/api/v1/ledgers/5/entries/0")).status == 200
    assert (await guarded.get("/api/v1/bookie/state")).status == 200
    config = await (await guarded.get("/api/v1/config/server_config", headers=auth)).json()
    assert config["admin_token"] == "******"  # never echoed


FENCING_READS = (
    "/api/v1/ledgers/{lid}/lac?replicated=1&fence=1",
    "/api/v1/ledgers/{lid}/entries/0?fence=1",
    "/api/v1/ledgers/{lid}/entries/0?fence=yes",  # whatever the route makes of the flag
    "/api/v1/ledgers/{lid}/lac?fence=1",
)


async def test_a_fencing_read_needs_the_token(guarded: Any) -> None:
    """A fencing read fences a live ledger (its writer's next add fails), or creates an
    unknown one fenced: a state change. Without the token (401) or with another (403) it
    changes nothing: the writer's next add goes in, no ledger is created; with it, it
    fences, and creates an unknown ledger fenced (BookKeeper's rule)."""
    live, unknown = LEDGER_ID_BASE + 5, LEDGER_ID_BASE + 6
    auth = {"Authorization": f"Bearer {TOKEN}"}

    async def replica_add(entry_id: int) -> Any:
        headers = {
            **auth,
            "Content-Type": protocol.OCTET_CONTENT_TYPE,
            protocol.REPLICATED_HEADER: "3/3/2",
            protocol.ENTRY_ID_HEADER: str(entry_id),
            protocol.LAC_HEADER: str(entry_id - 1),
        }
        path = f"/api/v1/ledgers/{live}/entries"
        return await guarded.post(path, data=b"e%d" % entry_id, headers=headers)

    async def ledgers() -> list[tuple[int, str]]:
        listed = (await (await guarded.get("/api/v1/ledgers")).json())["ledgers"]
        return [(m["ledgerId"], m["state"]) for m in listed]

    assert (await replica_add(0)).status == 201
    for lid in (live, unknown):
        for template in FENCING_READS:
            path = template.format(lid=lid)
            for method in ("GET", "HEAD"):
                r = await guarded.request(method, path)
                assert r.status == 401, (method, path)
                r = await guarded.request(method, path, headers={"Authorization": "Bearer no"})
                assert r.status == 403, (method, path)
            r = await guarded.get(path)
            assert (await r.json())["code"] == "unauthorized"
    assert await ledgers() == [(live, "open")]
    assert (await replica_add(1)).status == 201  # not fenced
    # Reads that fence nothing need no token, as before.
    for path in ("entries/1", "entries/1?fence=0", "lac", "lac?replicated=1"):
        assert (await guarded.get(f"/api/v1/ledgers/{live}/{path}")).status == 200, path
    # With the token: a fence, and an unknown ledger created fenced.
    r = await guarded.get(f"/api/v1/ledgers/{live}/entries/1?fence=1", headers=auth)
    assert r.status == 200 and await r.read() == b"e1"
    r = await replica_add(2)
    assert r.status == 409 and (await r.json())["code"] == protocol.LEDGER_FENCED
    r = await guarded.get(f"/api/v1/ledgers/{unknown}/lac?replicated=1&fence=1", headers=auth)
    assert r.status == 200 and (await r.json())["fenced"] is True
    assert await ledgers() == [(live, "fenced"), (unknown, "fenced")]


async def test_the_settings_need_the_token_and_show_no_credential(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    """They name host paths, the object store's endpoint and bucket: with a token set, only
    its holders read them; nobody reads a credential."""
    settings = make_settings(
        tmp_path / "d",
        admin_token=TOKEN,
        offload_access_key_id="AKIAEXAMPLEKEYID",
        offload_secret_access_key="wJalrXUtnFEMIsecret",
        offload_endpoint="http://minio-user:minio-password@minio:9000",
    )
    client = await aiohttp_client(build_app(settings))
    path = "/api/v1/config/server_config"
    r = await client.get(path)
    assert r.status == 401 and (await r.json())["code"] == "unauthorized"
    r = await client.get(path, headers={"Authorization": "Bearer wrong"})
    assert r.status == 403
    r = await client.get(path, headers={"Authorization": f"Bearer {TOKEN}"})
    text = await r.text()
    for secret in (
        TOKEN,
        "AKIAEXAMPLEKEYID",
        "wJalrXUtnFEMIsecret",
        "minio-user",
        "minio-password",
    ):
        assert secret not in text
    config = await r.json()
    assert config["offload_access_key_id"] == config["offload_secret_access_key"] == "******"
    assert config["offload_endpoint"] == "http://******@minio:9000"
    assert config["data_dir"] == str(tmp_path / "d")  # what is not a credential is shown


async def test_loopback_default_needs_no_token(client: Any) -> None:
    assert (await client.post("/api/v1/ledgers")).status == 201


@pytest.mark.parametrize(
    ("authorization", "status", "code"),
    [
        (b"Bearer " + TOKEN.encode(), 404, "stream_not_found"),  # past the token
        (b"bearer " + TOKEN.encode() + b" ", 404, "stream_not_found"),
        (b"Bearer " + TOKEN.encode() + b"\xc2\xa0", 404, "stream_not_found"),  # no-break space
        (b"Bearer wrong", 403, "forbidden"),
        (b"Bearer \xff\xfe", 403, "forbidden"),  # not UTF-8: compared as bytes, not a 500
        (b"Basic " + TOKEN.encode(), 401, "unauthorized"),
        (b"Bearer", 401, "unauthorized"),
    ],
)
async def test_the_fast_lane_and_the_routes_check_the_token_alike(
    guarded: Any, authorization: bytes, status: int, code: str
) -> None:
    """An add on a connection that starts with it (the fast lane's) and one on a connection
    that aiohttp serves (it started with a GET): the same answer to every Authorization."""
    add = (
        b"POST /api/v1/streams/nope/entries HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Length: 1\r\nAuthorization: %s\r\n\r\nx" % authorization
    )
    answers = []
    for first in (b"", b"GET /heartbeat HTTP/1.1\r\nHost: localhost\r\n\r\n"):
        conn = Conn(*await asyncio.open_connection(guarded.host, guarded.port))
        try:
            if first:
                await conn.send(first)
                assert (await conn.answer())[0] == 200
            await conn.send(add)
            answers.append(await conn.answer())
        finally:
            conn.writer.close()
            await conn.writer.wait_closed()
    (lane_status, _, lane_error), (routes_status, _, routes_error) = answers
    assert (lane_status, routes_status) == (status, status), answers
    assert lane_error["code"] == routes_error["code"] == code


async def test_a_write_token_beyond_ascii_passes_the_fast_lane_as_the_routes(client: Any) -> None:
    """Header bytes are UTF-8 to aiohttp: the lane reads a write token alike (it read them as
    Latin-1, and refused a token that aiohttp's routes took)."""
    token = "schlüssel-é"
    r = await client.post("/api/v1/ledgers", json={"writeToken": token})
    assert r.status == 201, await r.text()
    ledger = (await r.json())["ledgerId"]
    add = (
        b"POST /api/v1/ledgers/%d/entries HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1\r\n"
        b"X-Write-Token: %s\r\n\r\nx" % (ledger, token.encode())
    )
    conn = Conn(*await asyncio.open_connection(client.host, client.port))
    try:
        await conn.send(add)
        status, headers, reply = await conn.answer()
    finally:
        conn.writer.close()
        await conn.writer.wait_closed()
    assert headers["server"] == FAST_LANE_SERVER.decode()  # the lane answered
    assert (status, reply["entryId"]) == (201, 0), reply


async def test_a_write_token_that_is_not_utf8_is_refused_not_a_server_error(client: Any) -> None:
    """Header bytes that are not UTF-8 reach the engine as surrogates: its digest of the
    token raised (500 on both paths). The token is its bytes: a wrong one is 403."""
    r = await client.post("/api/v1/ledgers", json={"writeToken": "right"})
    assert r.status == 201, await r.text()
    ledger = (await r.json())["ledgerId"]
    add = (
        b"POST /api/v1/ledgers/%d/entries HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1\r\n"
        b"Content-Type: application/octet-stream\r\nX-Write-Token: \xff\xfe\r\n\r\nx" % ledger
    )
    conn = Conn(*await asyncio.open_connection(client.host, client.port))
    try:
        for _ in range(2):  # the fast lane, then aiohttp (a type the lane hands over)
            await conn.send(add)
            status, _headers, reply = await conn.answer()
            assert (status, reply["code"]) == (403, "write_token_mismatch"), reply
            add = add.replace(b"application/octet-stream", b"application/octet-stream; x=1")
    finally:
        conn.writer.close()
        await conn.writer.wait_closed()
    r = await client.post(
        f"/api/v1/ledgers/{ledger}/entries", data=b"y", headers={"X-Write-Token": "right"}
    )
    assert r.status == 201, await r.text()
