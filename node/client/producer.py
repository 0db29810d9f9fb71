"""Exactly-once appends to a stream over plain HTTP (the node's message deduplication,
node/streams/dedup.py; Pulsar's producer with deduplication on): each append carries the
producer's id and its next sequence id, and is sent again, with the same ids, after any
answer that leaves its outcome unknown (a timeout, a dropped or refused connection, a 5xx)
until a node answers with a position. The stream stores it once; a retry of one it stored
is answered 200 with ``X-Duplicate: true`` and the position it got the first time.

    async with StreamProducer(["http://n0:8080", "http://n1:8080"], "orders", "billing-1") as p:
        appended = await p.append(b"payload")        # appended.position: "L:E"
        appended = await p.append_batch(encode_batch(payloads), len(payloads))

The stream's ``deduplication`` policy must be on (else 409 ``deduplication_off``). A producer
id names one sequence: a producer that restarts goes on from the id after its last
acknowledged one (``next_sequence``; a smaller one is answered as a duplicate), or takes a
new producer id. ``resume()`` (or ``resume=True``, on entering ``async with``) asks the
stream for that id (``GET .../producers/{id}``, Pulsar's getLastSequenceId) and goes on
after it. 4xx answers (bad headers, a batch overlapping stored ids, too many
producers) are refusals: ``ProducerRefused``, nothing stored.

Only aiohttp: no import of the node (this is the client library's floor).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass
from types import TracebackType

import aiohttp

PRODUCER_HEADER = "X-Producer-Id"
SEQUENCE_HEADER = "X-Sequence-Id"
DUPLICATE_HEADER = "X-Duplicate"
OCTET = "application/octet-stream"  # node.wire's OCTET_CONTENT_TYPE
BATCH = "application/x-entry-batch"  # node.wire's BATCH_CONTENT_TYPE (encode_batch)
TIMEOUT_S = 30.0  # one attempt; past it the outcome is unknown and the append is sent again
RETRY_PAUSE_S = 0.2  # between two attempts (an owner being replaced answers 503 a while)
PRODUCER_NOT_FOUND = "producer_not_found"  # the stream holds no append of the producer


class ProducerRefused(Exception):
    """A 4xx: the node refused the append for good (nothing of it was stored)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code = status, code


@dataclass(frozen=True, slots=True)
class Appended:
    """Where the append is: ``first`` (a single entry: its position) .. ``last``, as ``L:E``.
    ``duplicate``: answered by a retry (stored by an earlier attempt). None: a duplicate of
    an append older than the producer's last five runs of appends, whose position the node
    no longer keeps."""

    first: str | None
    last: str | None
    sequence: int  # its first sequence id
    duplicate: bool
    attempts: int

    @property
    def position(self) -> str | None:
        return self.first


class StreamProducer:
    def __init__(
        self,
        urls: str | list[str],
        stream: str,
        producer_id: str,
        next_sequence: int = 0,
        *,
        token: str | None = None,
        timeout_s: float = TIMEOUT_S,
        retry_pause_s: float = RETRY_PAUSE_S,
        max_attempts: int | None = None,
        resume: bool = False,
    ) -> None:
        self._urls = itertools.cycle([urls] if isinstance(urls, str) else list(urls))
        self.stream = stream
        self.producer_id = producer_id
        self.next_sequence = next_sequence
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._pause_s = retry_pause_s
        self._max_attempts = max_attempts  # None: until a position comes
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()  # one append at a time: ids go out in order
        self.retries = 0  # attempts after the first, over every append
        self._resume = resume  # on entering: next_sequence from the stream (resume())

    async def append(self, payload: bytes) -> Appended:
        return await self._send(payload, OCTET, 1)

    async def append_batch(self, batch: bytes, count: int) -> Appended:
        """``batch``: ``count`` entries as node.wire.encode_batch makes them."""
        return await self._send(batch, BATCH, count)

    async def _send(self, body: bytes, content_type: str, count: int) -> Appended:
        async with self._lock:
            sequence = self.next_sequence
            headers = {
                **self._auth,
                "Content-Type": content_type,
                PRODUCER_HEADER: self.producer_id,
                SEQUENCE_HEADER: str(sequence),
            }
            attempt = 0
            while True:
                attempt += 1
                answer = await self._attempt(next(self._urls), body, headers, count)
                if answer is not None:
                    first, last, duplicate = answer
                    self.next_sequence = sequence + count
                    return Appended(first, last, sequence, duplicate, attempt)
                if self._max_attempts is not None and attempt >= self._max_attempts:
                    raise TimeoutError(
                        f"append of {self.producer_id} #{sequence}: no answer with a position "
                        f"in {attempt} attempts (its outcome is unknown: send it again with "
                        "the same ids to learn it)"
                    )
                self.retries += 1
                await asyncio.sleep(self._pause_s)

    async def resume(self) -> int:
        """Go on after the highest sequence id of this producer the stream holds (its
        appends still in flight settle first), or from ``next_sequence`` if that is higher;
        a producer it does not know (never appended, or forgotten once idle) keeps
        ``next_sequence``. Asked again, of the next URL, after any answer but a reply or a
        4xx. The next id to send."""
        attempt = 0
        while True:
            attempt += 1
            known, last = await self._last(next(self._urls))
            if known:
                if last is not None:
                    self.next_sequence = max(self.next_sequence, last + 1)
                return self.next_sequence
            if self._max_attempts is not None and attempt >= self._max_attempts:
                raise TimeoutError(
                    f"last sequence id of {self.producer_id}: no answer in {attempt} attempts"
                )
            self.retries += 1
            await asyncio.sleep(self._pause_s)

    async def _last(self, url: str) -> tuple[bool, int | None]:
        """One ask: (True, the last id, or None for a producer the stream does not know), or
        (False, None) without an answer."""
        try:
            async with self._open().get(
                f"{url}/api/v1/streams/{self.stream}/producers/{self.producer_id}",
                headers=self._auth,
                timeout=self._timeout,
            ) as response:
                raw = await response.read()
                status = response.status
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            return False, None
        if status == 200:
            return True, int(json.loads(raw)["lastSequenceId"])
        if 400 <= status < 500:
            refused = _refusal(status, raw)
            if refused.code == PRODUCER_NOT_FOUND:
                return True, None
            raise refused
        return False, None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _attempt(
        self, url: str, body: bytes, headers: dict[str, str], count: int
    ) -> tuple[str | None, str | None, bool] | None:
        """One send: (first, last, duplicate), or None when the outcome is unknown."""
        try:
            async with self._open().post(
                f"{url}/api/v1/streams/{self.stream}/entries",
                data=body,
                headers=headers,
                timeout=self._timeout,
            ) as response:
                raw = await response.read()
                status = response.status
                duplicate = response.headers.get(DUPLICATE_HEADER) == "true"
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            return None
        if status in (200, 201):
            reply = json.loads(raw)
            if count == 1 and "position" in reply:
                return reply["position"], reply["position"], duplicate
            return reply["firstPosition"], reply["lastPosition"], duplicate
        if 400 <= status < 500:
            raise _refusal(status, raw)
        return None  # 5xx: refused before anything happened, or unknown; either way again

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> StreamProducer:
        if self._resume:
            try:
                await self.resume()
            except BaseException:
                await self.close()
                raise
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


def _refusal(status: int, raw: bytes) -> ProducerRefused:
    """A 4xx answer as the error it is (its JSON code and message, when it has them)."""
    try:
        error = json.loads(raw)
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        code, message = f"http_{status}", raw[:200].decode("utf-8", "replace")
    return ProducerRefused(status, code, message)
