"""The client's half of the bookie protocol: replica adds, LAC reads and entry reads to one node
by its id. ``Transport`` is the contract (the simulation plugs in-memory nodes behind it);
``BookieClient`` speaks it over HTTP: replica adds on connections of their own (addpipe.py:
the hot path of every replicated append), everything else through one aiohttp session.

An answer is success, or a ReplicaError classified by the JSON body's ``code``: only
``entry_not_found``/``ledger_not_found`` mean "not here", never a status alone (a proxy's or an
unknown route's 404 is not the index speaking)."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import aiohttp

from node.client import addpipe
from node.client.addpipe import AddPipes
from node.client.errors import MetadataError, ReplicaError
from node.client.http1 import address
from node.client.protocol import (
    BATCH_CONTENT_TYPE,
    ENTRY_ID_HEADER,
    EXPECT_NODE_HEADER,
    LAC_HEADER,
    LAC_LENGTH_HEADER,
    NEXT_ENTRY_HEADER,
    OCTET_CONTENT_TYPE,
    RANGE_CONTENT_TYPE,
    RECOVERY_ADD_HEADER,
    REPLICATED_HEADER,
    decode_range,
    encode_batch,
    encode_range,
    replication_header,
)
from node.client.registry import Registry, UnknownNode
from node.client.stripes import IdRange, Stripe

# The session's own limit per request: a backstop only, callers time their calls themselves.
DEFAULT_REQUEST_TIMEOUT_S = 30.0
# Keep-alive connections per node (adds of one ledger go out concurrently).
DEFAULT_CONNECTIONS_PER_NODE = 16
# Replica adds pipelined on one connection once every connection to the node has one out
# (a node answers a connection's requests one at a time: more wait in its read-ahead).
DEFAULT_ADD_PIPELINE_DEPTH = 4

UNREACHABLE = addpipe.UNREACHABLE  # connection refused or reset, no answer
UNREGISTERED = "unregistered"  # no URL for the node id (not registered, or no store)
TIMEOUT = "timeout"  # no answer in the caller's time


@dataclass(frozen=True)
class LacAnswer:
    """A replica's view of a ledger: the highest writer LAC an add carried (and the bytes up to
    it), the highest id it stores, and whether it is fenced."""

    lac: int
    lac_length: int
    last_entry_id: int
    fenced: bool


@dataclass(frozen=True)
class MissingAnswer:
    """A replica's answer to the ledger check for ids [first, ``checked_to``] of a stripe:
    the ranges it lacks and how many of the stripe's ids it holds; ``next_from`` when the
    reply stopped at its limit of ranges."""

    missing: list[IdRange]
    checked_to: int
    held: int
    next_from: int | None


Replication = tuple[int, int, int]
# A replica add's head: ledger id, the node's fixed lines, Content-Type, Content-Length,
# first entry id, LAC, LAC length, E/Qw/Qa, the recovery line or nothing.
_ADD_HEAD = (
    b"POST /api/v1/ledgers/%%d/entries HTTP/1.1\r\n%%sContent-Type: %%s\r\n"
    b"Content-Length: %%d\r\n%s: %%d\r\n%s: %%d\r\n%s: %%d\r\n%s: %%s\r\n%%s\r\n"
    % (
        ENTRY_ID_HEADER.encode(),
        LAC_HEADER.encode(),
        LAC_LENGTH_HEADER.encode(),
        REPLICATED_HEADER.encode(),
    )
)
_RECOVERY_LINE = RECOVERY_ADD_HEADER.encode() + b": 1\r\n"
T = TypeVar("T")


@dataclass(frozen=True)
class RangeAnswer:
    """A node's answer to a range read: the entries it holds in the range asked, ascending,
    and where to read on when its byte budget cut the reply (None: the range is complete)."""

    entries: list[tuple[int, bytes]]
    next_entry_id: int | None


# A replica add already written to its node (Transport.start_add): its outcome, None once
# the node stored it, else ``add``'s ReplicaError; cancelling it stops waiting for it.
StartedAdd = asyncio.Future[None]


class Transport(Protocol):
    def start_add(
        self,
        node_id: str,
        ledger_id: int,
        entries: Sequence[tuple[int, bytes]],
        *,
        lac: int,
        lac_length: int,
        replication: Replication,
    ) -> StartedAdd | None:
        """``add``'s request written before this returns, when it can go without waiting (the
        node's address known, a connection to it idle): its outcome, settled as soon as the
        answer is in (a callback on it runs before any task awaiting it). None when it
        cannot (the caller then awaits ``add``, which waits for what is missing). Never
        raises: a failure is the outcome's, or ``add``'s."""

    async def add(
        self,
        node_id: str,
        ledger_id: int,
        entries: Sequence[tuple[int, bytes]],
        *,
        lac: int,
        lac_length: int,
        replication: Replication,
        recovery: bool = False,
    ) -> None:
        """Store ``entries`` (ids ascending) on the node durably; ReplicaError otherwise."""

    async def read_lac(
        self, node_id: str, ledger_id: int, *, fence: bool, replication: Replication
    ) -> LacAnswer: ...

    async def read_entry(
        self, node_id: str, ledger_id: int, entry_id: int, *, fence: bool
    ) -> bytes: ...

    async def read_range(self, node_id: str, ledger_id: int, first: int, last: int) -> RangeAnswer:
        """The entries of [first, last] the node holds, ascending (a replica of a striped
        ledger holds only its stripe, one that missed adds has gaps), never fencing."""

    async def missing(
        self, node_id: str, ledger_id: int, first: int, last: int, stripe: Stripe
    ) -> MissingAnswer:
        """Which of the stripe's ids in [first, last] the node lacks, from its index."""

    async def close(self) -> None: ...


def _settle_added(
    node_id: str, outcome: StartedAdd, answer: asyncio.Future[addpipe.Answer]
) -> None:
    if outcome.done():  # its waiter gave up (cancelled it)
        return
    if answer.cancelled():
        outcome.cancel()
        return
    error = answer.exception()
    if error is None:
        status, raw = answer.result()
        if status < 300:
            outcome.set_result(None)
            return
        error = _refusal(node_id, status, raw)
    outcome.set_exception(error)
    outcome.exception()  # retrieved: its writer may have stopped waiting meanwhile


def _stop_if_cancelled(sent: addpipe.Sent, outcome: StartedAdd) -> None:
    if outcome.cancelled():
        sent.stop_waiting()


def _add_request(
    fixed: bytes,
    ledger_id: int,
    entries: Sequence[tuple[int, bytes]],
    lac: int,
    lac_length: int,
    replication: Replication,
    recovery: bool,
) -> tuple[bytes, bytes]:
    """The head and body of a replica add over AddPipes (``fixed``: the node's own lines)."""
    body, content_type = _body(entries)
    head = _ADD_HEAD % (
        ledger_id,
        fixed,
        content_type.encode(),
        len(body),
        entries[0][0],
        lac,
        lac_length,
        replication_header(*replication).encode(),
        _RECOVERY_LINE if recovery else b"",
    )
    return head, body


def _body(entries: Sequence[tuple[int, bytes]]) -> tuple[bytes, str]:
    if len(entries) == 1:
        return entries[0][1], OCTET_CONTENT_TYPE
    first = entries[0][0]
    if all(eid == first + i for i, (eid, _) in enumerate(entries)):
        return encode_batch(p for _, p in entries), BATCH_CONTENT_TYPE
    return encode_range(entries), RANGE_CONTENT_TYPE


def _refusal(node_id: str, status: int, raw: bytes) -> ReplicaError:
    """A node's answer other than success, by the JSON body's code (``http_<status>`` when
    the body has none)."""
    code, message = f"http_{status}", ""
    try:
        answer = json.loads(raw)
        code, message = str(answer["code"]), str(answer.get("message", ""))
    except (ValueError, KeyError, TypeError):
        pass
    return ReplicaError(node_id, code, status, message)


class BookieClient:
    """The Transport over HTTP: replica adds on their own keep-alive connections (AddPipes),
    the rest through one aiohttp session (keep-alive pools per node)."""

    def __init__(
        self,
        registry: Registry,
        *,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        connections_per_node: int = DEFAULT_CONNECTIONS_PER_NODE,
        add_pipeline_depth: int = DEFAULT_ADD_PIPELINE_DEPTH,
        token: str | None = None,
    ) -> None:
        self._registry = registry
        # Nodes with an admin token refuse every write without it, replica adds included.
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._per_host = connections_per_node
        self._session: aiohttp.ClientSession | None = None
        self._pipes = AddPipes(
            connections=connections_per_node,
            depth=add_pipeline_depth,
            request_timeout_s=request_timeout_s,
            unreachable=registry.forget,
        )
        # Per node id: its base URL when last looked at, and (host, port, the headers every
        # add to it carries) or None for a URL the add path does not speak (aiohttp does).
        self._add_heads: dict[str, tuple[str, tuple[str, int, bytes] | None]] = {}

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=self._per_host)
            # Nodes set no cookies and compress nothing: no per-request work for either.
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
            )
        return self._session

    async def _request(
        self,
        method: str,
        node_id: str,
        path: str,
        *,
        headers: dict[str, str],
        data: bytes | None = None,
    ) -> tuple[bytes, Mapping[str, str]]:
        base = await self._url(node_id)
        headers[EXPECT_NODE_HEADER] = node_id
        headers.update(self._auth)
        try:
            async with self._open().request(
                method, base + path, headers=headers, data=data
            ) as resp:
                raw = await resp.read()
                if resp.status < 300:
                    return raw, resp.headers  # case-insensitive, kept after the release
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            self._registry.forget(node_id)
            raise ReplicaError(node_id, UNREACHABLE, 0, repr(error)) from None
        raise _refusal(node_id, status, raw)

    async def _url(self, node_id: str) -> str:
        try:
            return await self._registry.url(node_id)
        except (UnknownNode, MetadataError) as error:  # no address: as unreachable
            raise ReplicaError(node_id, UNREGISTERED, 0, str(error)) from None

    def _add_head(self, node_id: str, base: str) -> tuple[str, int, bytes] | None:
        known = self._add_heads.get(node_id)
        if known is not None and known[0] == base:
            return known[1]
        target = address(base)
        if target is not None:
            host, port, netloc = target
            lines = [
                b"Host: " + netloc,
                EXPECT_NODE_HEADER.encode() + b": " + node_id.encode("utf-8", "surrogateescape"),
                *(f"{name}: {value}".encode() for name, value in self._auth.items()),
            ]
            target = host, port, b"".join(line + b"\r\n" for line in lines)
        self._add_heads[node_id] = base, target
        return target

    def start_add(
        self,
        node_id: str,
        ledger_id: int,
        entries: Sequence[tuple[int, bytes]],
        *,
        lac: int,
        lac_length: int,
        replication: Replication,
    ) -> StartedAdd | None:
        base = self._registry.known_url(node_id)
        target = None if base is None else self._add_head(node_id, base)
        if target is None:
            return None
        host, port, fixed = target
        head, body = _add_request(fixed, ledger_id, entries, lac, lac_length, replication, False)
        sent = self._pipes.send_now(node_id, host, port, head, body)
        if sent is None:
            return None
        outcome: StartedAdd = asyncio.get_running_loop().create_future()
        sent.future.add_done_callback(functools.partial(_settle_added, node_id, outcome))
        outcome.add_done_callback(functools.partial(_stop_if_cancelled, sent))
        return outcome

    async def add(
        self,
        node_id: str,
        ledger_id: int,
        entries: Sequence[tuple[int, bytes]],
        *,
        lac: int,
        lac_length: int,
        replication: Replication,
        recovery: bool = False,
    ) -> None:
        base = await self._url(node_id)
        target = self._add_head(node_id, base)
        if target is not None:
            host, port, fixed = target
            head, body = _add_request(
                fixed, ledger_id, entries, lac, lac_length, replication, recovery
            )
            status, raw = await self._pipes.request(node_id, host, port, head, body)
            if status >= 300:
                raise _refusal(node_id, status, raw)
            return
        body, content_type = _body(entries)
        headers = {
            "Content-Type": content_type,
            ENTRY_ID_HEADER: str(entries[0][0]),
            LAC_HEADER: str(lac),
            LAC_LENGTH_HEADER: str(lac_length),
            REPLICATED_HEADER: replication_header(*replication),
        }
        if recovery:
            headers[RECOVERY_ADD_HEADER] = "1"
        await self._request(
            "POST", node_id, f"/api/v1/ledgers/{ledger_id}/entries", headers=headers, data=body
        )

    async def read_lac(
        self, node_id: str, ledger_id: int, *, fence: bool, replication: Replication
    ) -> LacAnswer:
        query = "?replicated=1&fence=1" if fence else "?replicated=1"
        raw, _ = await self._request(
            "GET",
            node_id,
            f"/api/v1/ledgers/{ledger_id}/lac{query}",
            headers={REPLICATED_HEADER: replication_header(*replication)},
        )
        try:
            answer = json.loads(raw)
            return LacAnswer(
                lac=int(answer["lac"]),
                lac_length=int(answer.get("lacLength") or 0),
                last_entry_id=int(answer.get("lastEntryId", -1)),
                fenced=bool(answer.get("fenced", False)),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise ReplicaError(node_id, "bad_answer", 200, repr(error)) from None

    async def read_entry(
        self, node_id: str, ledger_id: int, entry_id: int, *, fence: bool
    ) -> bytes:
        query = "?fence=1" if fence else ""
        raw, _ = await self._request(
            "GET", node_id, f"/api/v1/ledgers/{ledger_id}/entries/{entry_id}{query}", headers={}
        )
        return raw

    async def read_range(self, node_id: str, ledger_id: int, first: int, last: int) -> RangeAnswer:
        path = f"/api/v1/ledgers/{ledger_id}/entries?from={first}&to={last}"
        raw, headers = await self._request("GET", node_id, path, headers={})
        try:
            entries = list(decode_range(raw))
            cut = headers.get(NEXT_ENTRY_HEADER)
            return RangeAnswer(entries, None if cut is None else int(cut))
        except ValueError as error:
            raise ReplicaError(node_id, "bad_answer", 200, str(error)) from None

    async def missing(
        self, node_id: str, ledger_id: int, first: int, last: int, stripe: Stripe
    ) -> MissingAnswer:
        query = (
            f"from={first}&to={last}&ensembleSize={stripe.ensemble_size}"
            f"&writeQuorumSize={stripe.write_quorum}&position={stripe.position}"
        )
        raw, _ = await self._request(
            "GET", node_id, f"/api/v1/ledgers/{ledger_id}/missing?{query}", headers={}
        )
        try:
            answer = json.loads(raw)
            next_from = answer["nextFrom"]
            return MissingAnswer(
                missing=[(int(low), int(high)) for low, high in answer["missing"]],
                checked_to=int(answer["checkedTo"]),
                held=int(answer["heldEntries"]),
                next_from=None if next_from is None else int(next_from),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise ReplicaError(node_id, "bad_answer", 200, repr(error)) from None

    async def close(self) -> None:
        self._pipes.close()
        if self._session is not None:
            await self._session.close()
            self._session = None


async def within(node_id: str, call: Awaitable[T], timeout_s: float) -> T:
    """``call``'s answer, or a ReplicaError ``timeout`` (unknown) after ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):  # no extra task, unlike wait_for
            return await call
    except TimeoutError:
        raise timed_out(node_id, timeout_s) from None


def timed_out(node_id: str, timeout_s: float) -> ReplicaError:
    """The error of a request to ``node_id`` that had no answer in ``timeout_s``."""
    return ReplicaError(node_id, TIMEOUT, 0, f"no answer in {timeout_s} s")
