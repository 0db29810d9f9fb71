"""The executors' HTTP reads (node.audit.remote) survive a connection dropped mid-reply: a
loopback server that cuts its first reply short (and closes), then answers in full."""

from __future__ import annotations

import socket
import threading
import tracemalloc
from collections.abc import Iterator

import pytest

from node.audit import remote

DATA = bytes(range(256)) * 64  # 16 KiB
BIG = bytes(range(256)) * 32 * 1024  # 8 MiB: an executor's read (node.audit.ranges.READ_CHUNK)
ONE_COPY = 1.5  # peak memory of a range read, in bytes of the range: one copy and change


class Cutter:
    """A one-thread HTTP server on loopback: HEAD answers the size; the first GET sends
    half its range and closes the connection; later GETs send their range."""

    def __init__(self, data: bytes = DATA) -> None:
        self.data = data
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/logs/0.log"
        self.gets = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self._connection(conn)

    def _connection(self, conn: socket.socket) -> None:
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                buffer += chunk
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method = lines[0].split()[0]
            if method == "HEAD":
                size = len(self.data)
                conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n".encode())
                continue
            [asked] = [v for k, _, v in (x.partition(": ") for x in lines[1:]) if k == "Range"]
            first, last = (int(x) for x in asked.removeprefix("bytes=").split("-"))
            body = self.data[first : last + 1]
            conn.sendall(
                f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n"
                f"Content-Range: bytes {first}-{last}/{len(self.data)}\r\n\r\n".encode()
            )
            self.gets += 1
            if self.gets == 1:
                conn.sendall(body[: len(body) // 2])
                return  # dropped mid-reply
            conn.sendall(body)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def cutter() -> Iterator[Cutter]:
    server = Cutter()
    yield server
    server.close()


def test_a_range_cut_mid_reply_is_read_again(cutter: Cutter) -> None:
    http = remote.pool()
    try:
        log = remote.HttpLog(http, cutter.url)
        assert log.size == len(DATA)
        assert log.pread(4096, 1000) == DATA[1000:5096]
        assert cutter.gets == 2  # the first reply was cut: asked again
        assert log.pread(10_000, len(DATA) - 100) == DATA[-100:]  # up to the end
        assert log.pread(10, len(DATA)) == b""
    finally:
        http.clear()


def test_a_range_is_read_into_memory_once() -> None:
    """The body lands in the bytes handed to the scan without passing through other buffers
    first: each pass over 8 MiB costs an executor about what checking its CRCs does."""
    server = Cutter(BIG)
    http = remote.pool()
    try:
        log = remote.HttpLog(http, server.url)
        assert log.pread(1000, 0) == BIG[:1000]  # the first reply, cut and asked again
        tracemalloc.start()
        try:
            data = log.pread(len(BIG), 0)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert data == BIG
        assert peak < ONE_COPY * len(BIG), peak / len(BIG)
    finally:
        http.clear()
        server.close()
