"""The pipes of forwarded GETs and appends (node/http/forwardpipe.py) against a raw HTTP server on
loopback that writes the answers byte for byte as each test gives them: framing split at
every byte, chunked bodies, keep-alive reuse, and answers that must never be trusted (bytes
past the answer, no length, a connection closed mid-body)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from node.client.http1 import AnswerHead
from node.http.forwardpipe import PipeBroken, Pipes, request_head

CLOSE = b""  # in a server's answers: close the connection there (after the answer before)
HEAD = request_head("/api/v1/streams/s/entries?waitMs=10", "owner:1", [("X-A", "b")])


class RawServer:
    """Answers each request (read up to its blank line) with the next of ``answers``,
    written in pieces of ``piece`` bytes; counts connections and requests."""

    def __init__(self, answers: list[bytes], piece: int = 1 << 20) -> None:
        self.answers = answers
        self.piece = piece
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers and self.answers[0] is not CLOSE:
                self.requests.append(await reader.readuntil(b"\r\n\r\n"))
                answer = self.answers.pop(0)
                for at in range(0, len(answer), self.piece):
                    writer.write(answer[at : at + self.piece])
                    await writer.drain()
                    await asyncio.sleep(0)
                if self.answers and self.answers[0] is CLOSE:
                    self.answers.pop(0)
                    return
            await reader.read()  # until the client closes
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])


_servers: list[asyncio.Server] = []


@pytest.fixture
async def pipes() -> AsyncIterator[Pipes]:
    """The pool; the tests' servers closed after it."""
    pool = Pipes()
    yield pool
    pool.close()
    while _servers:
        server = _servers.pop()
        server.close()
        await server.wait_closed()


async def _serve(answers: list[bytes], piece: int = 1 << 20) -> RawServer:
    raw = RawServer(answers, piece)
    raw.server = await asyncio.start_server(raw.handle, "127.0.0.1", 0)
    _servers.append(raw.server)
    return raw


async def _get(pipes: Pipes, raw: RawServer) -> tuple[AnswerHead, bytes]:
    pipe = await pipes.connection("127.0.0.1", raw.port)
    pipe.send(HEAD)
    head = await asyncio.wait_for(pipe.head(), 5)
    return head, await asyncio.wait_for(pipe.body(), 5)


async def test_answers_split_at_every_byte_and_the_connection_reused(pipes: Pipes) -> None:
    sized = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Next-Position: 1:2\r\n\r\nhello"
    chunked = (
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3;ext=1\r\nabc\r\n10\r\n" + b"0123456789abcdef" + b"\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    empty = b"HTTP/1.1 204 No Content\r\n\r\n"
    raw = await _serve([sized, chunked, empty], piece=1)
    head, body = await _get(pipes, raw)
    assert (head.status, head.reason, head.length, body) == (200, "OK", 5, b"hello")
    assert ("X-Next-Position", "1:2") in head.headers
    head, body = await _get(pipes, raw)
    assert (head.status, head.length, body) == (201, None, b"abc0123456789abcdef")
    head, body = await _get(pipes, raw)
    assert (head.status, body) == (204, b"")
    assert raw.connections == 1  # one keep-alive connection for the three
    assert raw.requests[0] == HEAD


async def test_a_closing_answer_s_connection_is_not_reused(pipes: Pipes) -> None:
    closing = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
    raw = await _serve([closing])
    assert (await _get(pipes, raw))[1] == b"ok"
    raw.answers.append(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nno")
    assert (await _get(pipes, raw))[1] == b"no"
    assert raw.connections == 2


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA", "past the answer"),
        (b"HTTP/1.1 200 OK\r\n\r\nno length", "neither a Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\ncut", "it closed the connection"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "a bad chunk size"),
        (b"SMTP ready\r\n\r\n", "not an HTTP/1.1 answer"),
    ],
)
async def test_an_answer_that_cannot_be_trusted_fails_and_is_never_reused(
    pipes: Pipes, answer: bytes, why: str
) -> None:
    raw = await _serve([answer, CLOSE])  # closed after it: a cut answer ends there
    with pytest.raises(PipeBroken, match=why):
        await _get(pipes, raw)
    raw.answers[:] = [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]
    assert (await _get(pipes, raw))[1] == b"ok"  # on a new connection
    assert raw.connections == 2


async def test_an_append_s_body_follows_its_head_on_a_reused_connection(pipes: Pipes) -> None:
    bodies: list[bytes] = []
    connections = 0

    async def echo_length(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                assert head.startswith(b"POST /api/v1/streams/s/entries HTTP/1.1\r\n"), head
                length = int(head.partition(b"Content-Length: ")[2].partition(b"\r\n")[0])
                bodies.append(await reader.readexactly(length))
                said = str(length).encode()
                writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n" % len(said))
                writer.write(said)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed
        finally:
            writer.close()

    server = await asyncio.start_server(echo_length, "127.0.0.1", 0)
    _servers.append(server)
    port = server.sockets[0].getsockname()[1]
    sent = [b"x", bytes(range(256)) * 4096, b""]  # 1 MiB goes out whole after its head
    for body in sent:
        pipe = await pipes.connection("127.0.0.1", port)
        pipe.send(request_head("/api/v1/streams/s/entries", "owner:1", [], body), body)
        head = await asyncio.wait_for(pipe.head(), 5)
        assert (head.status, await pipe.body()) == (201, str(len(body)).encode())
    assert bodies == sent
    assert connections == 1
