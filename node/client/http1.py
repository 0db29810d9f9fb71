"""The HTTP/1.1 framing shared by the nodes' own keep-alive connections: replica adds
(addpipe.py) and forwarded reads and appends (node/http/forwardpipe.py). Both write their
requests themselves and read the answers without a client library's per-request objects;
what they agree on lives here: a node's address, how long an idle connection is kept, and an
answer's head (RFC 9112: status line, Content-Length, Transfer-Encoding, Connection)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

# A connection idle this long is closed rather than reused: well under the nodes' keep-alive
# (keepalive_timeout_s, 75 s), so that a request seldom meets a connection the node just closed.
IDLE_CLOSE_S = 15.0
MAX_ANSWER_HEAD = 64 * 1024  # the longest answer head read (the nodes' are a few hundred bytes)
NO_BODY = frozenset({204, 304})  # answers without a body whatever their headers say


class BadAnswer(ValueError):
    """An answer head this client does not read (not HTTP/1.x, a bad header or length)."""


@dataclass(frozen=True, slots=True)
class AnswerHead:
    status: int
    reason: str
    headers: list[tuple[str, str]]  # empty unless asked for (the relay's; adds need none)
    length: int | None  # of the body; None: chunked (Transfer-Encoding)
    closes: bool  # the node closes the connection after this answer


def address(base_url: str) -> tuple[str, int, bytes] | None:
    """(host, port, Host header) of a plain-HTTP base URL; None for any other (https)."""
    parts = urlsplit(base_url)
    if parts.scheme != "http" or parts.hostname is None:
        return None
    try:
        return parts.hostname, parts.port or 80, parts.netloc.encode("ascii")
    except (UnicodeError, ValueError):  # an IDN host or a bad port: aiohttp's rules apply
        return None


def parse_answer_head(raw: bytes, *, keep_headers: bool = False) -> AnswerHead:
    """The head of an answer (its bytes up to the empty line, excluded). BadAnswer when it
    is not one: a body of unknown length (neither Content-Length nor chunks) included.
    Bytes-level, since every replica add's answer passes here."""
    lines = raw.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or not code.isdigit():
        raise BadAnswer(f"not an HTTP/1.1 answer: {lines[0][:80]!r}")
    headers: list[tuple[str, str]] = []
    length, chunked, closes = -1, False, version != b"HTTP/1.1"
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            raise BadAnswer(f"a bad header line: {line[:80]!r}")
        key = name.strip().lower()
        if key == b"content-length":
            value = value.strip()
            if not value.isdigit() or length >= 0:
                raise BadAnswer("a bad or repeated Content-Length")
            length = int(value)
        elif key == b"transfer-encoding":
            if value.strip().lower() != b"chunked":
                raise BadAnswer(f"a Transfer-Encoding of {value.strip()[:80]!r}")
            chunked = True
        elif key == b"connection":
            closes = closes or b"close" in value.lower()
        if keep_headers:
            headers.append((name.strip().decode("latin-1"), value.strip().decode("latin-1")))
    status = int(code)
    if status in NO_BODY or 100 <= status < 200:
        body: int | None = 0
    elif chunked:
        body = None
    elif length < 0:
        raise BadAnswer("an answer with neither a Content-Length nor chunks")
    else:
        body = length
    return AnswerHead(status, reason.decode("latin-1"), headers, body, closes)
