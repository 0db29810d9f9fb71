"""A tailing consumer on a node that does not own its replicated stream: its long polls are
forwarded to the owner (node/http/forward.py, over read pipes: forwardpipe.py), on etcd and
four real node processes with a short owner lease (conftest.py).

- each long poll on the non-owner answers the entry just appended through the owner, byte
  for byte, at the position the append was acknowledged at, and never more than what was
  acknowledged: at each answer, exactly the entries appended so far;
- the forwarding node reuses one connection to the owner for those polls (a keep-alive
  read pipe, not a connection per poll);
- a long poll waiting on the non-owner while the owner is SIGKILLed answers at once with a
  retryable 503, and one waiting while the owner is SIGSTOPped answers 503 once the owner's
  lease ends (not after the forward's timeout); either way the next poll, after a takeover,
  reads every acknowledged entry."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from node.localcluster import LocalCluster
from node.wire import decode_stream_frames
from tests.harness.streams import REPLICATED, owner, put_stream
from tests.streams.conftest import OWNER_TTL_S

STREAM = "tailed"
ENTRIES = 20
WAIT_MS = 10_000  # the consumer's long poll: far longer than any answer here should take
RETRYABLE = {"owner_unreachable", "not_owner"}
TAKEOVER_TIMEOUT_S = 60.0
# A paused owner's forwarded long poll ends once its lease is seen gone: the lease, then a
# third of it (the forwarder's look at the owner key), and slack for a busy machine.
LEASE_NOTICED_S = OWNER_TTL_S * 4 / 3 + 3.0


async def _append(session: aiohttp.ClientSession, url: str, payload: bytes) -> str:
    async with session.post(
        f"{url}/api/v1/streams/{STREAM}/entries",
        data=payload,
        headers={"Content-Type": "application/octet-stream"},
    ) as response:
        body = await response.json()
        assert response.status == 201, body
        return str(body["position"])


async def _poll(
    session: aiohttp.ClientSession, url: str, start: str, wait_ms: int = WAIT_MS
) -> tuple[int, Any, list[tuple[str, bytes]], str | None]:
    """One long poll from ``start``: status, JSON error (or None), entries, X-Next-Position."""
    async with session.get(
        f"{url}/api/v1/streams/{STREAM}/entries?from={start}&waitMs={wait_ms}&limit=1000"
    ) as response:
        raw = await response.read()
        if response.status != 200:
            return response.status, await response.json(), [], None
        found = [(str(p), payload) for p, payload in decode_stream_frames(raw)]
        return 200, None, found, response.headers.get("X-Next-Position")


async def _setup(c: LocalCluster) -> tuple[str, str, str]:
    """The stream (3/3/2) with one entry appended through n0, which owns it: the owner,
    a node that does not own it, and the position after that entry."""
    status, body = await put_stream(c.url("n0"), STREAM, {"replication": REPLICATED})
    assert status == 201, body
    async with aiohttp.ClientSession() as session:
        first = await _append(session, c.url("n0"), b"first")
    stream_owner = await owner(c, STREAM)
    assert stream_owner is not None
    other = next(n for n in c.node_ids if n != stream_owner)
    ledger, _, entry = first.partition(":")
    return stream_owner, other, f"{ledger}:{int(entry) + 1}"


async def _read_after_takeover(url: str, start: str) -> list[tuple[str, bytes]]:
    """The entries from ``start`` through ``url`` once the stream is served again (retryable
    503s meanwhile: the dead or paused owner's lease has to end first)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TAKEOVER_TIMEOUT_S
    answers = []
    async with aiohttp.ClientSession() as session:
        while True:
            status, error, found, _after = await _poll(session, url, start, wait_ms=0)
            if status == 200:
                return found
            answers.append((status, error))
            assert status == 503 and error["code"] in RETRYABLE, answers
            assert loop.time() < deadline, answers
            await asyncio.sleep(0.2)


Waited = tuple[int, Any, float, str, str, list[tuple[str, bytes]]]


async def _waiting_poll_after(c: LocalCluster, fault: str) -> Waited:
    """Entries appended through the owner, a long poll waiting past them on a non-owner,
    then ``fault`` ("kill" or "stop") done to the owner: the poll's status and error, how
    long it took after the fault, the owner, the non-owner, and what was appended."""
    stream_owner, other, start = await _setup(c)
    appended = [(start.rpartition(":")[0] + ":0", b"first")]
    async with aiohttp.ClientSession() as session:
        for i in range(3):
            appended.append((await _append(session, c.url(stream_owner), b"e%d" % i), b"e%d" % i))
        ledger, _, entry = appended[-1][0].partition(":")
        before = await _forwarded(c.url(other))
        poll = asyncio.create_task(_poll(session, c.url(other), f"{ledger}:{int(entry) + 1}"))
        await _until_forwarded(c.url(other), before)
        started = time.monotonic()
        await asyncio.to_thread(c.kill if fault == "kill" else c.stop, stream_owner)
        status, error, found, _after = await asyncio.wait_for(poll, WAIT_MS / 1000 + 60)
        took = time.monotonic() - started
    assert found == []
    return status, error, took, stream_owner, other, appended


async def _forwarded(url: str) -> int:
    """Requests the node sent on to an owner (its status summary)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{url}/api/v1/status/summary") as response,
    ):
        assert response.status == 200
        return int((await response.json())["replication"]["streamRequestsForwarded"])


async def _until_forwarded(url: str, before: int) -> None:
    """Until the node forwarded more than ``before`` requests: the poll is on its way to
    the owner (were it not there yet when the owner fails, it would fail alike)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while await _forwarded(url) <= before:
        assert loop.time() < deadline, "the long poll was never forwarded"
        await asyncio.sleep(0.05)


async def test_long_polls_on_a_non_owner_answer_each_entry_appended_through_the_owner(
    stream_cluster: LocalCluster,
) -> None:
    c = stream_cluster
    stream_owner, other, start = await _setup(c)
    owner_url, other_url = c.url(stream_owner), c.url(other)
    appended: list[tuple[str, bytes]] = []
    async with aiohttp.ClientSession() as writer, aiohttp.ClientSession() as reader:
        position = start
        for i in range(ENTRIES):
            poll = asyncio.create_task(_poll(reader, other_url, position))
            payload = b"entry-%d" % i
            appended.append((await _append(writer, owner_url, payload), payload))
            status, error, found, after = await asyncio.wait_for(poll, WAIT_MS / 1000 + 10)
            assert status == 200, error
            # What was acknowledged, no more: the one entry, where its append said.
            assert found == appended[-1:], (i, found, appended[-1])
            assert after is not None
            position = after
        # Nothing more to read: the next poll waits, and ends empty.
        status, error, found, after = await _poll(reader, other_url, position, wait_ms=300)
        assert (status, found) == (200, []), error


async def test_a_long_poll_on_a_non_owner_fails_at_once_when_the_owner_is_killed(
    stream_cluster: LocalCluster,
) -> None:
    c = stream_cluster
    status, error, took, _owner, other, appended = await _waiting_poll_after(c, "kill")
    assert status == 503 and error["code"] == "owner_unreachable", error
    assert took < WAIT_MS / 1000 / 2, took  # the broken connection, not the poll's end
    assert await _read_after_takeover(c.url(other), appended[0][0]) == appended


async def test_a_long_poll_on_a_non_owner_ends_with_a_paused_owner_s_lease(
    stream_cluster: LocalCluster,
) -> None:
    c = stream_cluster
    status, error, took, stopped, other, appended = await _waiting_poll_after(c, "stop")
    try:
        assert status == 503 and error["code"] == "owner_unreachable", error
        assert "lost the stream" in error["message"], error
        assert took < LEASE_NOTICED_S, took  # not the poll's wait, nor the forward's timeout
        assert await _read_after_takeover(c.url(other), appended[0][0]) == appended
    finally:
        c.cont(stopped)
