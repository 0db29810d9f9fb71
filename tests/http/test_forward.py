"""Forwarding a stream request to the stream's owner (node/http/forward.py), over loopback:
a real node app forwards to a small aiohttp app playing the owner (it echoes what it got, or
misbehaves as a header asks: streams a large answer, holds it, dies, stays silent), and to a
second real node app, as owner, with an admin token on both.

The forwarding node forwards every stream route here (a test middleware stands in for the
ownership logic of the stream routes); its fast lane is off so that appends reach aiohttp."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from node.http import forward
from node.http.app import NodeRunner, build_app
from node.http.errors import ApiError
from node.http.forward import FORWARDED_BY, FORWARDER, Forwarder
from node.http.rawreply import SERVER_HEADER
from node.http.state import METRICS
from node.settings import Settings
from node.wire import decode_stream_frames
from tests.harness.node import NodeProcess
from tests.harness.ports import free_port
from tests.harness.settings import make_settings

NODE_ID = "node-a"
BEHAVE = "X-Test-Behave"  # what the test owner does with a request (it passes through)
LENGTH = "X-Test-Length"  # "die-mid-body": the Content-Length of the answer it breaks off
BIG = 8 * 1024 * 1024  # a large streamed answer: bytes
PIECE = 64 * 1024
IN_FLIGHT = 200
STAGGER = 25  # requests started at once (_staggered)
TOKEN = "s3cret"
JSON = {"Content-Type": "application/json"}
OWNER_URL: web.AppKey[list[str]] = web.AppKey("owner_url")  # [url]: the test may change it
SEEN: web.AppKey[list[str]] = web.AppKey("seen")


def _pattern(size: int) -> bytes:
    """Bytes that differ piece by piece: a reordered or dropped piece shows."""
    return b"".join(
        hashlib.sha256(str(i).encode()).digest() * (PIECE // 32) for i in range(size // PIECE)
    )


class Owner:
    """The owner's side: an aiohttp app that echoes, or misbehaves on ``X-Test-Behave``."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()  # "gated": the rest of the answer waits on it
        self.in_flight = 0
        self.most_in_flight = 0
        self.all_in = asyncio.Event()  # IN_FLIGHT requests held at once
        self.hung_up = asyncio.Event()  # a "silent" request's connection was closed
        self.bodies_read = 0
        self.always: str | None = None  # a behaviour for every request, whatever it asks
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.bodies_read += 1
        behave = self.always or request.headers.get(BEHAVE, "echo")
        if behave in ("not-owner", "overloaded"):
            code = behave.replace("-", "_")
            return web.json_response(
                {"code": code, "message": "no"}, status=503, headers={"Retry-After": "1"}
            )
        if behave == "big":
            reply = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            reply.enable_chunked_encoding()
            await reply.prepare(request)
            data = memoryview(_pattern(BIG))
            for at in range(0, BIG, PIECE):
                await reply.write(data[at : at + PIECE])
            await reply.write_eof()
            return reply
        if behave == "sized":
            data = _pattern(1024 * 1024)
            return web.Response(body=data, content_type="application/octet-stream")
        if behave == "gated":
            reply = web.StreamResponse()
            reply.enable_chunked_encoding()
            await reply.prepare(request)
            await reply.write(b"first")
            await self.gate.wait()
            await reply.write(b"-rest")
            await reply.write_eof()
            return reply
        if behave == "die":  # the process is gone after reading the body: a reset
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(10)
        if behave == "die-mid-body":
            reply = web.StreamResponse()
            reply.content_length = int(request.headers.get(LENGTH, "1000"))
            await reply.prepare(request)
            await reply.write(b"x" * 100)
            await reply.drain()
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(10)
        if behave == "silent":
            try:  # until the connection closes: aiohttp's test server cancels us then
                await asyncio.Event().wait()
            finally:
                self.hung_up.set()
            return web.Response()
        if behave == "slow":
            await asyncio.sleep(float(request.headers["X-Test-Delay"]))
        if behave == "held":
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            if self.in_flight == IN_FLIGHT:
                self.all_in.set()
            try:
                await asyncio.wait_for(self.all_in.wait(), 30)
            finally:
                self.in_flight -= 1
        if behave == "chunked-small":
            reply = web.StreamResponse(status=201, headers={"Content-Type": "application/json"})
            reply.enable_chunked_encoding()
            await reply.prepare(request)
            await reply.write(b'{"position": ')
            await reply.write(b'"1:2"}')
            await reply.write_eof()
            return reply
        assert request.transport is not None
        if behave == "close-later":  # the owner drops the idle connection (keep-alive timeout)
            asyncio.get_running_loop().call_later(0.05, request.transport.close)
        echo = {
            "peer": request.transport.get_extra_info("peername")[1],
            "method": request.method,
            "target": request.raw_path,
            "headers": [[k.decode(), v.decode()] for k, v in request.raw_headers],
            "body": body.hex(),
        }
        reply = web.json_response(echo, status=207, headers={"X-Owner": "yes"})
        if behave == "close":
            reply.force_close()  # Connection: close
        return reply


async def _forward_streams(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The stand-in for the stream routes' ownership logic: every stream request goes to
    the owner, but one that came forwarded (503 not_owner)."""
    if not request.path.startswith("/api/v1/streams"):
        return await handler(request)
    if forward.forwarded(request):
        raise ApiError(503, forward.NOT_OWNER, "not the owner either")
    request.app[SEEN].append(request.raw_path)
    forwarder, urls = request.app[FORWARDER], request.app[OWNER_URL]
    if len(urls) == 1:
        return await forwarder.forward(request, urls[0])
    # A caller that remembers owners: told the first moved on, it asks the next.
    try:
        return await forwarder.forward(request, urls[0], raise_moved=True)
    except forward.OwnerMoved as moved:
        request.app[SEEN].append(f"moved from {moved.url}")
        return await forwarder.forward(request, urls[1], raise_moved=True)


def _forwarding_app(settings: Settings, owner_url: str) -> web.Application:
    app = build_app(settings)
    forward.install(app)
    app[OWNER_URL] = [owner_url]
    app[SEEN] = []
    app.middlewares.append(web.middleware(_forward_streams))
    return app


def _settings(tmp_path: Path, name: str, **overrides: Any) -> Settings:
    return make_settings(tmp_path / name, id=name, http_fast_lane_max_body=0, **overrides)


Setup = tuple[Any, Owner]  # the client of the forwarding node, the owner


async def _setup(
    tmp_path: Path, aiohttp_client: Any, aiohttp_server: Any, forward_timeout_s: float
) -> Setup:
    owner = Owner()
    server = await aiohttp_server(owner.app)
    url = str(server.make_url("")).rstrip("/")
    settings = _settings(
        tmp_path, NODE_ID, stream_forward_timeout_s=forward_timeout_s, max_long_poll_ms=5000
    )
    client = await aiohttp_client(_forwarding_app(settings, url))
    return client, owner


@pytest.fixture
async def setup(tmp_path: Path, aiohttp_client: Any, aiohttp_server: Any) -> Setup:
    """Forwarding with stream_forward_timeout_s = 1 s: silent owners are found quickly."""
    return await _setup(tmp_path, aiohttp_client, aiohttp_server, 1.0)


@pytest.fixture
async def roomy(tmp_path: Path, aiohttp_client: Any, aiohttp_server: Any) -> Setup:
    """Forwarding with room for 200 requests to come in on 2 busy cores."""
    return await _setup(tmp_path, aiohttp_client, aiohttp_server, 20.0)


async def _staggered(calls: list[Callable[[], Awaitable[Any]]]) -> list[Any]:
    """Start the calls a group at a time, all in flight together: a burst of 200 connects
    at once overflows a listener's accept queue (aiohttp listens with a backlog of 128)."""
    tasks = []
    for at in range(0, len(calls), STAGGER):
        tasks += [asyncio.create_task(call()) for call in calls[at : at + STAGGER]]
        await asyncio.sleep(0.05)
    return await asyncio.wait_for(asyncio.gather(*tasks), 60)


def _count(client: Any, outcome: str) -> float:
    registry = client.app[METRICS].registry
    value = registry.get_sample_value(
        "storage_node_stream_forwarded_requests_total", {"outcome": outcome}
    )
    assert value is not None  # every outcome's series exists from the start
    return float(value)


async def _error(response: Any, code: str) -> dict[str, Any]:
    assert response.status == 503, await response.text()
    assert response.headers["Retry-After"] == "1"
    body = await response.json()
    assert set(body) == {"code", "message"} and body["code"] == code, body
    return dict(body)


async def test_the_owner_gets_the_request_as_the_client_sent_it(setup: Setup) -> None:
    client, _ = setup
    target = "/api/v1/streams/orders%2Fx%3A/entries?waitMs=0&limit=7&a=%20b%26"
    payload = bytes(range(256)) * 3
    response = await client.post(
        target,
        data=payload,
        headers={
            "Content-Type": "application/octet-stream",
            "Authorization": "Bearer abc def",
            "X-Custom": "kept",
            "X-Expect-Node": NODE_ID,  # checked here; the owner would refuse it (421)
            "Keep-Alive": "timeout=5",
            "Proxy-Authorization": "Basic Zm9v",
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "named by Connection: hop-by-hop",
            "X-Request-Id": "client-rid-1",
            "Expect": "100-continue",
        },
    )
    assert response.status == 207, await response.text()  # the owner's status, as it was
    assert response.headers["X-Owner"] == "yes"  # and its headers
    assert response.headers["X-Request-Id"] == "client-rid-1"
    assert response.headers["Server"] == SERVER_HEADER.decode()  # written whole, at once
    echo = await response.json()
    assert echo["method"] == "POST"
    # Path and query string as the node got them (the client's yarl normalized "%3A"),
    # still encoded.
    assert echo["target"] == client.app[SEEN][-1]
    assert echo["target"] == target.replace("%3A", ":")
    assert bytes.fromhex(echo["body"]) == payload
    headers: dict[str, list[str]] = {}
    for name, value in echo["headers"]:
        headers.setdefault(name.lower(), []).append(value)
    assert headers["authorization"] == ["Bearer abc def"]
    assert headers["content-type"] == ["application/octet-stream"]
    assert headers["x-custom"] == ["kept"]
    assert headers["x-forwarded-by"] == [NODE_ID]
    assert headers["x-request-id"] == ["client-rid-1"]  # both nodes' logs name it alike
    assert headers["content-length"] == [str(len(payload))]
    for gone in ("x-expect-node", "keep-alive", "proxy-authorization", "x-hop", "expect"):
        assert gone not in headers, gone
    assert "x-test-behave" not in headers
    # Nothing the client did not send: aiohttp's automatic headers stay off.
    assert set(headers) <= {
        "host",
        "authorization",
        "content-type",
        "x-custom",
        "x-forwarded-by",
        "x-request-id",
        "content-length",
        "connection",
        "accept",
        "accept-encoding",
        "user-agent",
    }
    assert _count(client, "ok") == 1


async def test_a_request_without_a_body_or_content_type_stays_so(setup: Setup) -> None:
    client, _ = setup
    for method in ("GET", "DELETE", "POST"):
        response = await client.request(
            method,
            "/api/v1/streams/orders",
            skip_auto_headers=("Content-Type", "User-Agent", "Accept", "Accept-Encoding"),
        )
        assert response.status == 207
        echo = await response.json()
        names = {name.lower() for name, _ in echo["headers"]}
        assert echo["method"] == method and echo["body"] == ""
        assert "content-type" not in names  # an append without one is the owner's 415
        assert names <= {"host", "x-forwarded-by", "x-request-id", "content-length"}, names


async def test_a_forwarded_request_is_never_forwarded_again(setup: Setup) -> None:
    client, _ = setup
    response = await client.get("/api/v1/streams/orders", headers={FORWARDED_BY: "node-b"})
    await _error(response, "not_owner")
    assert client.app[SEEN] == []


def test_forwarded_tells_by_the_header() -> None:
    from aiohttp.test_utils import make_mocked_request

    assert forward.forwarded(make_mocked_request("GET", "/", headers={FORWARDED_BY: "b"}))
    assert not forward.forwarded(make_mocked_request("GET", "/"))


async def test_a_large_answer_streams_back_byte_for_byte(setup: Setup) -> None:
    client, _ = setup
    response = await client.get("/api/v1/streams/orders/entries", headers={BEHAVE: "big"})
    assert response.status == 200
    # Passed on as it came, in chunks: never gathered to learn its length.
    assert response.headers.get("Transfer-Encoding") == "chunked"
    digest, size = hashlib.sha256(), 0
    async for chunk in response.content.iter_any():
        digest.update(chunk)
        size += len(chunk)
    assert size == BIG
    assert digest.digest() == hashlib.sha256(_pattern(BIG)).digest()
    # An answer of known length keeps it: the client can tell a whole answer from a cut one.
    response = await client.get("/api/v1/streams/orders/entries", headers={BEHAVE: "sized"})
    assert response.headers["Content-Length"] == str(1024 * 1024)
    assert await response.read() == _pattern(1024 * 1024)


async def test_chunks_reach_the_client_before_the_owner_finishes(setup: Setup) -> None:
    client, owner = setup
    response = await client.get("/api/v1/streams/orders/entries", headers={BEHAVE: "gated"})
    assert response.status == 200
    first = await asyncio.wait_for(response.content.readany(), 5)
    assert first == b"first"  # while the owner still waits for the gate
    assert not owner.gate.is_set()
    owner.gate.set()
    assert await response.read() == b"-rest"


async def test_a_long_poll_longer_than_the_forward_timeout_is_answered(setup: Setup) -> None:
    """stream_forward_timeout_s is 1 s here: a long poll's waitMs (2.5 s) is added to it, so
    an owner answering after 2 s is waited for; without waitMs it is not."""
    client, _ = setup
    slow = {BEHAVE: "slow", "X-Test-Delay": "2"}
    started = time.monotonic()
    response = await client.get("/api/v1/streams/orders/entries?waitMs=2500", headers=slow)
    assert response.status == 207, await response.text()
    assert (await response.json())["target"].endswith("waitMs=2500")
    assert time.monotonic() - started >= 2
    started = time.monotonic()
    response = await client.get("/api/v1/streams/orders/entries", headers=slow)
    body = await _error(response, "owner_unreachable")
    assert time.monotonic() - started < 1.9
    assert "did not answer" in body["message"]


def test_the_timeouts_allow_the_longest_long_poll(tmp_path: Path) -> None:
    """By default a forwarded request may take max_long_poll_ms (60 s) plus 30 s before its
    answer begins, 30 s between its chunks, 5 s to connect, and has no total bound (a large
    answer to a slow client is bounded by reply_write_timeout_s instead)."""
    settings = make_settings(tmp_path)
    assert settings.stream_forward_timeout_s == 30.0
    assert settings.stream_forward_connect_timeout_s == 5.0
    forwarder = Forwarder(settings, build_app(settings)[METRICS])
    longest = forwarder._timeout(f"/x?waitMs={settings.max_long_poll_ms}")
    assert longest.total is None and longest.sock_connect == 5.0
    assert longest.sock_read == settings.max_long_poll_ms / 1000 + 30.0
    assert forwarder._timeout("/x").sock_read == 30.0
    # A waitMs the owner will refuse (400) is given the longest wait: no guess is wrong.
    assert forwarder._timeout("/x?waitMs=abc").sock_read == 90.0
    assert forwarder._timeout("/x?waitMs=99999999").sock_read == 90.0


async def test_an_owner_that_is_down_is_unreachable(setup: Setup) -> None:
    client, _ = setup
    down = f"http://127.0.0.1:{free_port()}"
    client.app[OWNER_URL][0] = down
    for method in ("GET", "POST"):  # nothing was sent: an append too is known not done
        response = await client.request(
            method, "/api/v1/streams/orders/entries", data=b"x" if method == "POST" else None
        )
        body = await _error(response, "owner_unreachable")
        # In words: the owner's URL and the OS's reason, no exception's repr.
        said = (
            f"the stream's owner at {down} did not answer: could not connect (Connection refused)"
        )
        assert body["message"] == said, body
    assert _count(client, "unreachable") == 2
    assert _count(client, "unknown") == 0


async def test_an_owner_that_dies_after_an_appends_body_leaves_it_unknown(
    setup: Setup,
) -> None:
    client, owner = setup
    response = await client.post(
        "/api/v1/streams/orders/entries",
        data=b"payload",
        headers={BEHAVE: "die", "Content-Type": "application/octet-stream"},
    )
    body = await _error(response, "append_outcome_unknown")
    assert "may or may not be in the stream" in body["message"]
    assert "closed the connection without answering" in body["message"], body
    assert "Error(" not in body["message"], body
    assert owner.bodies_read == 1
    # A request that changes nothing twice (a read, a cursor's ack) is just unreachable.
    for method, path in (
        ("GET", "/api/v1/streams/orders/entries"),
        ("POST", "/api/v1/streams/orders/cursors/c/ack"),
    ):
        response = await client.request(method, path, data=b"{}", headers={BEHAVE: "die", **JSON})
        await _error(response, "owner_unreachable")
    assert (_count(client, "unknown"), _count(client, "unreachable")) == (1, 2)


async def test_an_owner_silent_after_an_append_leaves_it_unknown(setup: Setup) -> None:
    client, owner = setup
    started = time.monotonic()
    response = await client.post(
        "/api/v1/streams/orders/entries", data=b"payload", headers={BEHAVE: "silent"}
    )
    body = await _error(response, "append_outcome_unknown")
    assert "silent for longer than stream_forward_timeout_s" in body["message"], body
    assert time.monotonic() - started < 5  # stream_forward_timeout_s: 1 s
    await asyncio.wait_for(owner.hung_up.wait(), 5)  # its connection was closed


async def test_a_large_answer_cut_by_the_owner_is_cut_for_the_client(setup: Setup) -> None:
    client, _ = setup
    length = forward.WHOLE_ANSWER_MAX + 1  # streamed: its head is passed on before its body
    response = await client.get(
        "/api/v1/streams/orders/entries", headers={BEHAVE: "die-mid-body", LENGTH: str(length)}
    )
    assert response.status == 200 and response.headers["Content-Length"] == str(length)
    with pytest.raises(aiohttp.ClientPayloadError):
        await response.read()
    assert _count(client, "unreachable") == 1
    # The node goes on serving.
    response = await client.get("/api/v1/streams/orders")
    assert response.status == 207


async def test_a_small_answer_cut_by_the_owner_is_unreachable(setup: Setup) -> None:
    """An answer read whole before any of it is passed on: cut, the client gets the 503 of
    an owner that did not answer (retryable), and an append's stays unknown."""
    client, _ = setup
    response = await client.get("/api/v1/streams/orders/entries", headers={BEHAVE: "die-mid-body"})
    body = await _error(response, "owner_unreachable")
    assert "connection" in body["message"].lower() or "payload" in body["message"].lower(), body
    response = await client.post(
        "/api/v1/streams/orders/entries", data=b"x", headers={BEHAVE: "die-mid-body"}
    )
    await _error(response, "append_outcome_unknown")
    assert _count(client, "unreachable") == 1 and _count(client, "unknown") == 1
    response = await client.get("/api/v1/streams/orders")
    assert response.status == 207


class _ServedAsServeDoes(TestServer):
    """The node's runner without aiohttp's test-server handler cancellation: as ``serve``
    runs it, a handler goes on after its client hangs up unless the node cancels it."""

    async def _make_runner(self, **kwargs: Any) -> NodeRunner:
        kwargs.pop("handler_cancellation", None)
        return NodeRunner(self.app, **kwargs)


async def test_a_forwarded_long_poll_ends_with_its_client(
    tmp_path: Path, aiohttp_client: Any, aiohttp_server: Any
) -> None:
    owner = Owner()
    url = str((await aiohttp_server(owner.app)).make_url("")).rstrip("/")
    app = _forwarding_app(_settings(tmp_path, NODE_ID, max_long_poll_ms=60_000), url)
    client = await aiohttp_client(_ServedAsServeDoes(app))
    target = client.make_url("/api/v1/streams/orders/entries?waitMs=60000")
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.get(target, headers={BEHAVE: "silent"}))
        await asyncio.sleep(0.5)
        request.cancel()  # the client hangs up
        with pytest.raises(asyncio.CancelledError):
            await request
    await asyncio.wait_for(owner.hung_up.wait(), 3)  # so does the owner's connection
    registry = app[METRICS].registry
    labels = {"method": "GET", "route": "/api/v1/streams/{name}/entries", "status": "499"}
    for _ in range(50):
        if registry.get_sample_value("storage_node_http_request_duration_seconds_count", labels):
            break
        await asyncio.sleep(0.05)
    assert registry.get_sample_value("storage_node_http_request_duration_seconds_count", labels)


async def test_many_forwarded_requests_in_flight_at_once(roomy: Setup) -> None:
    """200 requests held by the owner at the same time (it answers none before all came):
    no pool limit queues them, and each gets its own answer."""
    client, owner = roomy
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int) -> None:
            url = client.make_url(f"/api/v1/streams/s{i}/entries?n={i}")
            async with session.post(url, data=b"%d" % i, headers={BEHAVE: "held"}) as r:
                assert r.status == 207, await r.text()
                echo = await r.json()
            assert echo["target"] == f"/api/v1/streams/s{i}/entries?n={i}"
            assert bytes.fromhex(echo["body"]) == b"%d" % i

        await _staggered([functools.partial(one, i) for i in range(IN_FLIGHT)])
    assert owner.most_in_flight == IN_FLIGHT
    assert _count(client, "ok") == IN_FLIGHT


async def test_the_session_closes_with_the_app(tmp_path: Path) -> None:
    app = build_app(_settings(tmp_path, NODE_ID))
    forwarder = forward.install(app)
    server = TestServer(app)
    await server.start_server()
    session = forwarder._session
    assert session is not None and not session.closed
    await server.close()
    assert session.closed and forwarder._session is None


async def test_an_owner_process_killed_during_an_append_leaves_it_unknown(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    """A real owner node that SIGKILLs itself at the fsync of the forwarded append (its
    first: the stream's creation needs none), after it read the body and wrote the entry,
    before it answered. The client hears 503 append_outcome_unknown: whether the restarted
    owner holds the entry depends on what of the journal's write the crash kept, which no
    one on the client's side can tell."""
    env = {"NODE_ID": "owner", "NODE_FAULTS": '["journal.fsync=crash,after=0"]'}
    owner = NodeProcess(tmp_path / "owner", env=env)
    await asyncio.to_thread(owner.start)
    client = await aiohttp_client(_forwarding_app(_settings(tmp_path, NODE_ID), owner.url))
    response = await client.put("/api/v1/streams/orders", json={})
    assert response.status == 201, await response.text()
    octet = {"Content-Type": "application/octet-stream"}
    response = await client.post("/api/v1/streams/orders/entries", data=b"one", headers=octet)
    body = await _error(response, "append_outcome_unknown")
    assert owner.url in body["message"]
    await asyncio.to_thread(owner.proc.wait, 10)  # type: ignore[union-attr]
    assert owner.proc is not None and owner.proc.returncode == -9  # SIGKILL, as armed
    # The owner gone for good: unreachable, for reads and appends alike (nothing was sent).
    for method in ("GET", "POST"):
        response = await client.request(
            method, "/api/v1/streams/orders/entries", data=b"two", headers=octet
        )
        await _error(response, "owner_unreachable")
    assert (_count(client, "unknown"), _count(client, "unreachable")) == (1, 2)
    again = NodeProcess(tmp_path / "owner", env={"NODE_ID": "owner"})
    await asyncio.to_thread(again.start)
    stream = await asyncio.to_thread(again.get_json, "/api/v1/streams/orders")
    assert stream["entries"] in (0, 1)  # either: that is what "unknown" says


async def test_a_real_owner_node_serves_the_forwarded_stream(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    """Two real nodes with the admin token: the stream's routes sent to node A are served by
    node B, long poll included."""
    owner_client = await aiohttp_client(
        build_app(make_settings(tmp_path / "b", id="node-b", admin_token=TOKEN))
    )
    owner_url = str(owner_client.make_url("")).rstrip("/")
    client = await aiohttp_client(
        _forwarding_app(_settings(tmp_path, NODE_ID, admin_token=TOKEN), owner_url)
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    octet = {**auth, "Content-Type": "application/octet-stream"}
    response = await client.put("/api/v1/streams/orders", json={}, headers=auth)
    assert response.status == 201, await response.text()
    assert response.headers["X-Node-Id"] == NODE_ID  # the answer came from node A
    response = await client.put(
        "/api/v1/streams/orders", json={}
    )  # no token: refused (by A, as B would)
    assert response.status == 401 and (await response.json())["code"] == "unauthorized"
    response = await client.post("/api/v1/streams/orders/entries", data=b"one", headers=octet)
    assert response.status == 201, await response.text()
    first = (await response.json())["position"]
    poll = asyncio.create_task(
        client.get(f"/api/v1/streams/orders/entries?from={first}&waitMs=0&limit=10")
    )
    read = await poll
    assert read.status == 200
    assert [p for _, p in decode_stream_frames(await read.read())] == [b"one"]
    # A long poll past the end, answered by an append sent to the owner directly.
    nxt = read.headers["X-Next-Position"]
    poll = asyncio.create_task(
        client.get(f"/api/v1/streams/orders/entries?from={nxt}&waitMs=4000&limit=10")
    )
    await asyncio.sleep(0.3)
    assert not poll.done()
    response = await owner_client.post("/api/v1/streams/orders/entries", data=b"two", headers=octet)
    assert response.status == 201
    read = await asyncio.wait_for(poll, 5)
    assert read.status == 200
    assert [p for _, p in decode_stream_frames(await read.read())] == [b"two"]
    # The owner's own errors pass through as it gave them.
    response = await client.get("/api/v1/streams/missing")
    assert response.status == 404 and (await response.json())["code"] == "stream_not_found"

    # 200 appends forwarded at once: each acknowledged once, at its own position.
    async def append(i: int) -> str:
        response = await client.post(
            "/api/v1/streams/orders/entries", data=b"%d" % i, headers=octet
        )
        assert response.status == 201, await response.text()
        return str((await response.json())["position"])

    positions = await _staggered([functools.partial(append, i) for i in range(IN_FLIGHT)])
    assert len(set(positions)) == IN_FLIGHT
    response = await owner_client.get("/api/v1/streams/orders")
    assert (await response.json())["entries"] == 2 + IN_FLIGHT
    assert client.app[SEEN] and not owner_client.app.get(SEEN)


async def test_an_owner_that_owns_the_stream_no_more(setup: Setup, aiohttp_server: Any) -> None:
    """503 not_owner from the node asked: passed on as it came by default; with
    raise_moved, OwnerMoved, and the caller asks again elsewhere (appends too: the node
    that said not_owner did nothing). Any other 503 passes on as it came."""
    client, owner = setup
    first = client.app[OWNER_URL][0]
    path = "/api/v1/streams/orders/entries"
    octet = {"Content-Type": "application/octet-stream"}
    owner.always = "not-owner"
    response = await client.post(path, data=b"one", headers=octet)
    await _error(response, "not_owner")
    second = Owner()
    client.app[OWNER_URL].append(str((await aiohttp_server(second.app)).make_url("")).rstrip("/"))
    response = await client.post(path, data=b"one", headers=octet)
    assert response.status == 207, await response.text()
    echo = await response.json()
    assert bytes.fromhex(echo["body"]) == b"one" and echo["method"] == "POST"
    assert client.app[SEEN][-1] == f"moved from {first}"
    owner.always = "overloaded"
    response = await client.get(path, headers={"X-Request-Id": "rid-7"})
    body = await _error(response, "overloaded")
    assert body["message"] == "no" and response.headers["X-Request-Id"] == "rid-7"
    assert client.app[SEEN][-1] == "/api/v1/streams/orders/entries"  # no move
    assert _count(client, "unknown") == _count(client, "unreachable") == 0


async def test_an_owner_that_is_down_is_asked_again_by_a_caller_that_remembers(
    setup: Setup, aiohttp_server: Any
) -> None:
    """A refused connection (the remembered owner stopped) sent nothing: with raise_moved,
    OwnerMoved, and the caller asks again, an append too (it reaches the next owner once);
    counted unreachable."""
    client, _ = setup
    down = f"http://127.0.0.1:{free_port()}"
    client.app[OWNER_URL][0] = down
    second = Owner()
    client.app[OWNER_URL].append(str((await aiohttp_server(second.app)).make_url("")).rstrip("/"))
    octet = {"Content-Type": "application/octet-stream"}
    response = await client.post("/api/v1/streams/orders/entries", data=b"one", headers=octet)
    assert response.status == 207, await response.text()
    assert bytes.fromhex((await response.json())["body"]) == b"one"
    assert client.app[SEEN][-1] == f"moved from {down}"
    assert second.bodies_read == 1
    assert (_count(client, "unreachable"), _count(client, "unknown")) == (1, 0)
