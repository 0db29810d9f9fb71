"""The answer heads the nodes' own connections read (node/client/http1.py)."""

from __future__ import annotations

import pytest

from node.client.http1 import BadAnswer, parse_answer_head


def test_a_length_and_the_connection_are_read_headers_kept_only_when_asked() -> None:
    raw = b"HTTP/1.1 201 Created\r\nContent-Length: 12\r\nX-Node-Id: n1\r\nConnection: Close"
    head = parse_answer_head(raw)
    assert (head.status, head.reason, head.length, head.closes) == (201, "Created", 12, True)
    assert head.headers == []
    kept = parse_answer_head(raw, keep_headers=True)
    assert kept.headers == [("Content-Length", "12"), ("X-Node-Id", "n1"), ("Connection", "Close")]


@pytest.mark.parametrize(
    ("raw", "length", "closes"),
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked", None, False),
        (b"HTTP/1.1 204 No Content\r\nContent-Length: 99", 0, False),  # no body, whatever it says
        (b"HTTP/1.1 304 Not Modified", 0, False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 0", 0, True),  # 1.0: the node closes
        (b"HTTP/1.1 200 OK\r\nconnection: keep-alive\r\ncontent-length:  7 ", 7, False),
    ],
)
def test_framings(raw: bytes, length: int | None, closes: bool) -> None:
    head = parse_answer_head(raw)
    assert (head.length, head.closes) == (length, closes)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"HTTP/2 200 OK\r\nContent-Length: 1", "not an HTTP/1.1 answer"),
        (b"HTTP/1.1 OK\r\nContent-Length: 1", "not an HTTP/1.1 answer"),
        (b"HTTP/1.1 200 OK", "neither a Content-Length nor chunks"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1", "bad or repeated Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 1", "repeated"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip", "Transfer-Encoding of"),
        (b"HTTP/1.1 200 OK\r\nno colon here", "a bad header line"),
    ],
)
def test_heads_that_are_not_answers_are_refused(raw: bytes, why: str) -> None:
    with pytest.raises(BadAnswer, match=why):
        parse_answer_head(raw)
