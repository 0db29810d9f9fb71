"""A StreamManager's backend when a metadata store is configured: the stream's ledgers are
replicated ledgers (node.client) and its records live in the metadata store, every write of
them one transaction guarded by the stream's ownership (node.streams.ownership).

Keys (under the cluster's prefix; values are the records of node.streams.model):

    streams/<name>                          the stream record, plus "replication"
    stream-cursors/<name>/<cursor>          a cursor's mark-delete
    stream-doomed/<19-digit ledger id>      a ledger a trim or a deletion dropped, deleted next
    stream-dedup/<name>                     the producer table's snapshot (node.streams.dedup)

Why the guard: the manager writes a record only after the write that holds it, and a node
that lost the stream (paused past its lease, partitioned) must write nothing more. Every
commit compares ``stream-owners/<name>`` with the revision this node created it at: once the
lease is gone or another node holds the key, the commit changes nothing and the stream is
dropped here (NotOwner). A commit whose answer was lost is resolved by reading the keys back.

Adds go through this node's LedgerHandle of the stream's open ledger. An add the client
cannot finish (fenced by a takeover, the ledger lost) is AppendOutcomeUnknown: it may be in
the ledger the new owner closed, so the manager never retries it on another ledger.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any, NoReturn

from node.client import Client
from node.client.errors import (
    AddFailed,
    AddOutcomeUnknown,
    CasConflict,
    ClientError,
    LedgerClosedElsewhere,
    LedgerFencedError,
    MetadataError,
    NoSuchKey,
    NoSuchLedger,
    NotEnoughNodes,
    OutcomeUnknown,
)
from node.client.errors import RecoveryFailed as ClientRecoveryFailed
from node.client.metadata.loop import read_with_retry
from node.client.metadata.store import MetadataStore
from node.client.reader import ReadHandle
from node.client.writer import LedgerHandle
from node.settings import Settings
from node.storage.errors import LedgerClosed, LedgerNotFound, StorageError, StorageIoError
from node.storage.index import STREAM_PROPERTY, LedgerMeta, LedgerState
from node.streams.dedup import SNAPSHOT_PREFIX
from node.streams.manager import (
    AppendOutcomeUnknown,
    MetadataUnavailable,
    NotOwner,
    RecoveryFailed,
)
from node.streams.manager import NotEnoughNodes as StreamNotEnoughNodes
from node.streams.model import CURSOR_PREFIX, DOOMED_PREFIX, STREAM_PREFIX, Replication
from node.streams.ownership import Ownership

STREAMS_KEY = "streams/"
CURSORS_KEY = "stream-cursors/"
DOOMED_KEY = "stream-doomed/"
DEDUP_KEY = "stream-dedup/"
READERS_KEPT = 64  # closed ledgers kept open for reading (their metadata, read once)


def stream_key(name: str) -> str:
    return STREAMS_KEY + name


def dedup_key(name: str) -> str:
    return DEDUP_KEY + name


def cursor_prefix(name: str) -> str:
    return f"{CURSORS_KEY}{name}/"


def store_key(record_key: bytes) -> tuple[str, str | None]:
    """The metadata store's key of a record's key (node.streams.model), and its stream (None
    for a doomed record, which names a ledger)."""
    if record_key.startswith(STREAM_PREFIX):
        name = record_key.removeprefix(STREAM_PREFIX).decode()
        return stream_key(name), name
    if record_key.startswith(CURSOR_PREFIX):
        stream, _, cursor = record_key.removeprefix(CURSOR_PREFIX).partition(b"\0")
        return cursor_prefix(stream.decode()) + cursor.decode(), stream.decode()
    if record_key.startswith(DOOMED_PREFIX):
        return f"{DOOMED_KEY}{int(record_key.removeprefix(DOOMED_PREFIX)):019d}", None
    if record_key.startswith(SNAPSHOT_PREFIX):
        name = record_key.removeprefix(SNAPSHOT_PREFIX).decode()
        return dedup_key(name), name
    raise ValueError(f"not a stream record key: {record_key[:60]!r}")


def _metadata_error(error: MetadataError) -> StorageError:
    return MetadataUnavailable(f"the metadata store did not answer: {error}")


class ReplicatedBackend:
    def __init__(
        self,
        settings: Settings,
        client: Client,
        store: MetadataStore,
        ownership: Ownership,
        replication_of: Callable[[str], Replication],
    ) -> None:
        self.settings = settings
        self._client = client
        self._store = store
        self._ownership = ownership
        self._replication_of = replication_of  # a stream's E/Qw/Qa, for its next ledger
        self._writers: dict[int, LedgerHandle] = {}  # open ledgers this node writes
        self._closed: dict[int, LedgerMeta] = {}  # ledgers closed here, or recovered
        self._readers: OrderedDict[int, ReadHandle] = OrderedDict()
        self._ending: dict[int, asyncio.Future[LedgerMeta]] = {}  # recoveries under way

    # --- records -------------------------------------------------------------------------

    async def load_records(self) -> dict[bytes, bytes]:
        return {}  # nothing is served at start: a stream is taken over on its first request

    async def write_records(self, changes: dict[bytes, bytes | None]) -> None:
        translated: dict[str, bytes | None] = {}
        streams: set[str] = set()
        for record_key, value in changes.items():
            key, stream = store_key(record_key)
            translated[key] = value
            if stream is not None:
                streams.add(stream)
        guards: dict[str, int] = {}
        for name in streams:
            try:
                guards.update(self._ownership.guard(name))
            except KeyError:
                raise NotOwner(f"stream {name} is no longer served by this node") from None
        try:
            await self._store.commit(guards, translated)
        except CasConflict:
            for name in streams:
                self._ownership.lost(name)  # its on_lost drops the stream here
            raise NotOwner(
                f"stream {', '.join(sorted(streams))} is served by another node now: retry"
            ) from None
        except OutcomeUnknown as error:
            if not await self._landed(translated):
                raise _metadata_error(error) from error
        except MetadataError as error:
            raise _metadata_error(error) from error

    async def _landed(self, changes: dict[str, bytes | None]) -> bool:
        """Whether a commit whose answer was lost went in: every key as it would have left it
        (another writer would have failed the guard, so nobody else changed them since)."""
        try:
            for key, value in changes.items():
                found = await read_with_retry(self._store, key)
                if (None if found is None else found.value) != value:
                    return False
        except MetadataError:
            return False
        return True

    # --- ledgers -------------------------------------------------------------------------

    def ledgers(self) -> Iterable[LedgerMeta]:
        return ()  # no local scan: the metadata store's record is the stream's truth

    def ledger(self, ledger_id: int) -> LedgerMeta:
        writer = self._writers.get(ledger_id)
        if writer is not None:
            return LedgerMeta(
                ledger_id,
                LedgerState.OPEN,
                lac=writer.lac,
                last_entry_id=writer.lac,
                entries=writer.lac + 1,
                payload_bytes=writer.length,
                properties=dict(writer.metadata.properties),
            )
        closed = self._closed.get(ledger_id)
        if closed is None:
            raise LedgerNotFound(f"ledger {ledger_id} is not open or closed on this node")
        return closed

    def remember_closed(self, ledger_id: int, last_entry_id: int, length: int) -> None:
        """A ledger closed here or recovered (by a takeover, or after an add whose outcome
        the writer lost): its end, as the metadata store holds it. Its writer, if this node
        had one, goes: the writer's LAC stops short of entries the recovery kept, and
        readers must see those at once (an append settled by the recovered end is
        acknowledged)."""
        self._forget(ledger_id)
        self._closed[ledger_id] = LedgerMeta(
            ledger_id,
            LedgerState.CLOSED,
            lac=last_entry_id,
            last_entry_id=last_entry_id,
            entries=last_entry_id + 1,
            payload_bytes=length,
            closed_ms=int(time.time() * 1000),
        )

    async def create_ledger(
        self,
        ledger_id: int | None = None,
        properties: dict[str, str] | None = None,
        write_token: str | None = None,
    ) -> tuple[LedgerMeta, bool]:
        properties = dict(properties or {})
        stream = properties[STREAM_PROPERTY]
        e, qw, qa = self._replication_of(stream)
        try:
            writer = await self._client.create_ledger(e, qw, qa, properties)
        except NotEnoughNodes as error:
            raise self._too_few_nodes(error) from None
        except MetadataError as error:
            raise _metadata_error(error) from error
        self._writers[writer.id] = writer
        meta = LedgerMeta(writer.id, created_ms=writer.metadata.ctime_ms, properties=properties)
        return meta, True

    def _too_few_nodes(self, error: NotEnoughNodes) -> StorageError:
        """Too few registered nodes, or a registry the store lost: this node registers as
        long as it runs, so its own registration missing from the read that placement just
        made means the store dropped registrations (their leases ended, as they all do when
        etcd comes back from a pause longer than registration_ttl_s), not that nodes left:
        the nodes register again within registration_ttl_s / 3."""
        node_id = self.settings.id
        if self._client.registry.registered(node_id):
            return StreamNotEnoughNodes(str(error))
        return MetadataUnavailable(
            f"the metadata store holds no registration of this node ({node_id!r}), so its "
            f"list of nodes is not current (leases lost, e.g. after an etcd pause or "
            f"restart): the nodes register again shortly ({error})"
        )

    def _writer(self, ledger_id: int) -> LedgerHandle:
        writer = self._writers.get(ledger_id)
        if writer is None:
            if ledger_id in self._closed:
                raise LedgerClosed(f"ledger {ledger_id} is closed")
            raise NotOwner(f"ledger {ledger_id} is not written by this node: retry")
        return writer

    def add_entry(
        self, ledger_id: int, entry_id: int | None, payload: bytes, write_token: str | None = None
    ) -> Coroutine[Any, Any, int]:
        return _first(self.add_entries(ledger_id, [payload]))

    def add_entries(
        self, ledger_id: int, payloads: list[bytes], write_token: str | None = None
    ) -> Coroutine[Any, Any, list[int]]:
        """The entries sent before this returns (an idle writer writes its requests in the
        caller's step: an append's replicas hear of it without waiting for the loop); the
        coroutine awaits their acknowledgement, or raises what refused them."""
        try:
            first, last = self._writer(ledger_id).submit(payloads)
        except AddFailed as error:  # nothing was sent
            return _raise(LedgerClosed(f"ledger {ledger_id}: {error}"))
        except StorageError as error:
            return _raise(error)
        return self._acknowledged(ledger_id, first, len(payloads), last)

    async def _acknowledged(
        self, ledger_id: int, first: int, count: int, last: asyncio.Future[int]
    ) -> list[int]:
        try:
            end = await last
        except AddOutcomeUnknown as error:
            return await self._settle_unknown(ledger_id, first, count, error)
        return list(range(first, end + 1))

    async def _settle_unknown(
        self, ledger_id: int, first: int, count: int, error: AddOutcomeUnknown
    ) -> list[int]:
        """An append the writer lost (fenced by a recovery, or the writer gave up). The
        ledger's recovered end decides: entries up to it are in the ledger, the ones after it
        never will be. So the append is acknowledged when all of it is in, tried again on a
        new ledger (LedgerClosed) when none of it is, and unknown only when the end cannot be
        learnt or cuts a batch in two."""
        try:
            end = (await self._recovered_end(ledger_id)).last_entry_id
        except StorageError:
            end = None
        if end is not None and end < first:
            raise LedgerClosed(f"ledger {ledger_id} ended at {end}, before this append")
        if end is not None and end >= first + count - 1:
            return list(range(first, first + count))
        raise AppendOutcomeUnknown(
            f"the append may or may not be in the stream: ledger {ledger_id}, {error}"
        )

    async def close_ledger(self, ledger_id: int, write_token: str | None = None) -> LedgerMeta:
        writer = self._writers.get(ledger_id)
        if writer is None:
            return self.ledger(ledger_id)
        try:
            meta = await writer.close()
        except (LedgerFencedError, LedgerClosedElsewhere):
            # A recovery closed it (autorecovery after its grace, an operator, a new owner):
            # its end is the metadata's. Whether the stream is still ours is the guard's
            # business, at the next record write.
            self._forget(ledger_id)
            return await self._recovered_end(ledger_id)
        except MetadataError as error:
            raise _metadata_error(error) from error
        self.remember_closed(ledger_id, meta.last_entry_id, meta.length)
        return self._closed[ledger_id]

    async def _recovered_end(self, ledger_id: int) -> LedgerMeta:
        """The end of a ledger this node no longer writes, after a recovery (one at a time:
        the adds that failed together all ask)."""
        closed = self._closed.get(ledger_id)
        if closed is not None:
            return closed
        ending = self._ending.get(ledger_id)
        if ending is None:
            ending = self._ending[ledger_id] = asyncio.ensure_future(self._recover(ledger_id))
            ending.add_done_callback(lambda _: self._ending.pop(ledger_id, None))
        return await asyncio.shield(ending)

    async def _recover(self, ledger_id: int) -> LedgerMeta:
        try:
            found = await self._client.recover_ledger(ledger_id)  # CLOSED: no-op; else ends it
        except NoSuchLedger:
            raise LedgerNotFound(f"ledger {ledger_id} does not exist") from None
        except MetadataError as error:
            raise _metadata_error(error) from error
        except ClientRecoveryFailed as error:
            # Too few replicas answered (one is down): 503, retried once they are back, as a
            # takeover's (node.streams.router); not an I/O error of this node.
            raise RecoveryFailed(
                f"ledger {ledger_id}: its end cannot be settled: {error}"
            ) from None
        except ClientError as error:
            raise StorageIoError(f"ledger {ledger_id}: its recovery failed: {error}") from None
        self.remember_closed(ledger_id, found["lastEntryId"], found["length"])
        return self._closed[ledger_id]

    async def delete_ledger(self, ledger_id: int, write_token: str | None = None) -> None:
        """Its metadata goes; each node reclaims its replica once it sees it gone."""
        self._forget(ledger_id)
        self._closed.pop(ledger_id, None)
        self._readers.pop(ledger_id, None)
        try:
            await self._client.delete_ledger(ledger_id)
        except NoSuchLedger:
            raise LedgerNotFound(f"ledger {ledger_id} does not exist") from None
        except MetadataError as error:
            raise _metadata_error(error) from error

    def _forget(self, ledger_id: int) -> None:
        self._writers.pop(ledger_id, None)

    def forget_stream(self, name: str) -> None:
        """The stream is another node's now: drop its writers without closing them (the new
        owner closed the ledger; their adds in flight end fenced, outcome unknown)."""
        for ledger_id, writer in list(self._writers.items()):
            if writer.metadata.properties.get(STREAM_PROPERTY) == name:
                self._forget(ledger_id)

    async def _reader(self, ledger_id: int) -> ReadHandle:
        writer = self._writers.get(ledger_id)
        if writer is not None:
            return ReadHandle(self._client, writer.metadata, writer.lac)
        reader = self._readers.get(ledger_id)
        if reader is None:
            try:
                reader = await self._client.open_ledger(ledger_id)
            except (NoSuchLedger, NoSuchKey):
                raise LedgerNotFound(f"ledger {ledger_id} does not exist") from None
            except MetadataError as error:
                raise _metadata_error(error) from error
            if reader.closed:  # an open one's LAC moves: read it anew next time
                self._readers[ledger_id] = reader
                while len(self._readers) > READERS_KEPT:
                    self._readers.popitem(last=False)
        else:
            self._readers.move_to_end(ledger_id)
        return reader

    async def read_range(
        self, ledger_id: int, first: int, last: int | None = None
    ) -> AsyncIterator[tuple[int, bytes]]:
        reader = await self._reader(ledger_id)
        end = reader.last_entry_id if last is None else min(last, reader.last_entry_id)
        if end < first:
            return
        try:
            async for entry in reader.read(first, end):
                yield entry
        except ClientError as error:  # ReadFailed, or the store: the entry may well exist
            raise StorageIoError(f"ledger {ledger_id}: {error}") from None


async def _first(ids: Coroutine[Any, Any, list[int]]) -> int:
    return (await ids)[0]


async def _raise(error: BaseException) -> NoReturn:
    raise error
