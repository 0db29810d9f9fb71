"""Which node serves a replicated stream, and taking one over (Pulsar's topic ownership and
managed-ledger open, over the metadata store).

Every node answers every stream route. ``route(name)`` says who serves it: this node (it
owns the stream), or the owner's URL (the HTTP layer forwards the request there). With no
live owner, the node that was asked takes the stream over:

1. create ``stream-owners/<name>`` under this node's lease (one node wins; the others
   forward to it);
2. read the stream record and its cursors;
3. fence and recover the last ledger, and the one before it (a rollover cut short leaves it
   OPEN: see ``_settle_ends``), and take their ends from the recovery (BookKeeper's: no add
   of the old owner can be acknowledged after this, every acknowledged one is kept);
4. open a new ledger and commit the record naming it, with the recovered ledgers' ends, in
   one transaction guarded by the ownership key (the "ledgers to logs" order of BookKeeper's
   protocol: fence the last ledger before appending anywhere new).

The old owner, paused or partitioned meanwhile, finds its adds fenced and settles each by
the recovered end (node.streams.replicated: acknowledged where the recovery kept it, else
never in the stream); its next metadata write is refused by the guard, and it drops the
stream then, or when its lease is found expired.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import weakref
from collections.abc import Callable

from node.client import Client
from node.client.bookies import Transport
from node.client.errors import (
    CasConflict,
    ClientError,
    MetadataError,
    NoSuchKey,
    NoSuchLedger,
)
from node.client.errors import RecoveryFailed as ClientRecoveryFailed
from node.client.metadata.store import MetadataStore
from node.settings import Settings
from node.storage.clock import Clock
from node.storage.errors import StorageError
from node.streams.cache import EntryCache
from node.streams.manager import (
    MetadataUnavailable,
    NotOwner,
    RecoveryFailed,
    StreamManager,
    StreamNotFound,
)
from node.streams.manager import NotEnoughNodes as StreamNotEnoughNodes
from node.streams.model import NAME, Cursor, Replication, Stream, cursor_key, doomed_objects
from node.streams.ownership import KEEPALIVES_PER_TTL, OWNERS_PREFIX, Ownership
from node.streams.replicated import (
    DOOMED_KEY,
    STREAMS_KEY,
    ReplicatedBackend,
    cursor_prefix,
    dedup_key,
    stream_key,
)

log = logging.getLogger(__name__)

OWNERS_CACHED = 10_000  # streams whose owner a node remembers (each a name and a URL)


class StreamRouter:
    def __init__(
        self,
        node_id: str,
        manager: StreamManager,
        backend: ReplicatedBackend,
        ownership: Ownership,
        client: Client,
        owner_cache_s: float = 0.0,
    ) -> None:
        self.node_id = node_id
        self._manager = manager
        self._backend = backend
        self._ownership = ownership
        self._client = client
        self._store = client.store
        # One takeover at a time per name (weak: a name nobody asks for any more costs nothing)
        self._taking: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self.takeovers = 0  # streams this node took over (not counting ones it created)
        self.forwarded = 0  # requests the HTTP layer sent on to another node, the owner
        # name -> (owner's URL, monotonic time it stops being trusted): a forwarded request
        # does not read the owner key first (etcd's linearizable read is most of a hop)
        self._owners: dict[str, tuple[str, float]] = {}
        self._owner_cache_s = owner_cache_s
        self.on_takeover: Callable[[], None] = lambda: None  # the metric's increment
        self._sweep: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._ownership.start()
        self._sweep = asyncio.get_running_loop().create_task(self.finish_deletions())

    async def finish_deletions(self) -> None:
        """Ledgers a trim or a stream deletion dropped but did not delete (its node died
        between the two steps), and the objects of offloaded ones: any node finishes them
        (at its start and at each offload run); deleting one twice is harmless. A record
        whose objects the store would not delete stays for the next time."""
        try:
            doomed = await self._store.range(DOOMED_KEY)
            for key, found in doomed:
                ledger_id = int(key.removeprefix(DOOMED_KEY))
                with contextlib.suppress(NoSuchLedger):
                    await self._client.delete_ledger(ledger_id)
                attempt = doomed_objects(found.value)
                if attempt is not None and self._manager.remove_objects is not None:
                    try:
                        await self._manager.remove_objects(ledger_id, attempt)
                    except StorageError as error:
                        log.warning("ledger %d is deleted; its objects stay for now: %s",
                                    ledger_id, error.message)  # fmt: skip
                        continue
                with contextlib.suppress(CasConflict, NoSuchKey):
                    await self._store.delete(key, found.revision)
                log.info("deleted %s, which a trim or a stream deletion left", key)
        except ClientError as error:
            log.warning("left deletions not finished (the next try does): %s", error)

    async def offloaded_objects(self) -> set[tuple[int, str]]:
        """(ledger id, attempt) of every offload a replicated stream's record or a doomed
        record names, whichever node owns the stream: objects no node may call unknown."""
        known = set()
        try:
            for _key, found in await self._store.range(STREAMS_KEY):
                for info in Stream.decode(found.value).ledgers:
                    if info.offload is not None:
                        known.add((info.ledger_id, info.offload.attempt))
            for key, found in await self._store.range(DOOMED_KEY):
                attempt = doomed_objects(found.value)
                if attempt is not None:
                    known.add((int(key.removeprefix(DOOMED_KEY)), attempt))
        except MetadataError as error:
            raise MetadataUnavailable(f"the metadata store did not answer: {error}") from None
        return known

    async def stop(self) -> None:
        """Give every owned stream up at once (the lease is revoked: the next request to any
        node takes them over, recovering their open ledgers), then close the client."""
        if self._sweep is not None:
            self._sweep.cancel()
            await asyncio.gather(self._sweep, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._ownership.stop()
        await self._client.close()

    def owns(self, name: str) -> bool:
        return self._manager.owns(name) and name in self._ownership.owned

    async def route(self, name: str, *, create: bool = False) -> str | None:
        """None when this node serves ``name`` (after taking it over if nobody did), else
        the owner's URL. ``create``: a PUT, which may make the stream; otherwise a stream
        that does not exist is StreamNotFound."""
        if self.owns(name):
            return None
        if not NAME.fullmatch(name):
            # No stream has such a name: answered here (a PUT: invalid_name; else not found)
            # without an owner key written for it in the metadata store.
            return None
        cached = self._owners.get(name)
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        lock = self._taking.get(name)
        if lock is None:
            lock = self._taking[name] = asyncio.Lock()
        async with lock:
            if self.owns(name):
                return None
            try:
                owner = await self._ownership.owner(name)
                if owner is not None and owner.node != self.node_id:
                    url = owner.url or await self._client.registry.url(owner.node)
                    if len(self._owners) >= OWNERS_CACHED:
                        self._owners.clear()  # a bound, not an LRU: refilled at one read each
                    self._owners[name] = (url, time.monotonic() + self._owner_cache_s)
                    return url
                # No owner, or this node's key from a lease it no longer holds (it restarted):
                # acquire takes such a key back at once rather than waiting out its lease.
                return await self._take_over(name, create)
            except MetadataError as error:
                raise MetadataUnavailable(f"the metadata store did not answer: {error}") from None

    async def _take_over(self, name: str, create: bool) -> str | None:
        # Already ours without the manager serving it: a PUT creating it is under way here.
        # A failure below must not give up the ownership that creation relies on.
        creating = name in self._ownership.owned
        if await self._ownership.acquire(name) is None:
            owner = await self._ownership.owner(name)
            if owner is None:
                raise NotOwner(f"stream {name}: its owner just changed, retry")
            return owner.url or await self._client.registry.url(owner.node)
        try:
            found = await self._store.get(stream_key(name))
            if found is None:
                if create:
                    return None  # the PUT creates it, as its owner
                raise StreamNotFound(f"stream {name[:100]!r} does not exist")
            stream = Stream.decode(found.value)
            cursors = [
                Cursor.decode(cursor_key(name, key.rsplit("/", 1)[1]), value.value)
                for key, value in await self._store.range(cursor_prefix(name))
            ]
            snapshot = await self._store.get(dedup_key(name))
            settled = await self._settle_ends(stream)
            self._manager.adopt(stream, cursors, None if snapshot is None else snapshot.value)
            if settled:
                await self._open_or_read_only(stream)
            await self._load_table(name)
        except BaseException:
            if not creating:
                self._manager.drop(name)
                with contextlib.suppress(Exception):
                    await self._ownership.release(name)
            raise
        self.takeovers += 1
        self.on_takeover()
        log.info("took stream %s over (%d ledgers)", name, len(stream.ledgers))
        return None

    async def _load_table(self, name: str) -> None:
        """A deduplicating stream's producer table, rebuilt before the stream is served (its
        snapshot and the entries after it: node.streams.dedup). Entries that cannot be read
        now leave it for the first append with producer headers to rebuild."""
        try:
            await self._manager.load_table(name)
        except StorageError as error:
            log.warning("stream %s: producer table not rebuilt at takeover (the first "
                        "append with producer headers does): %s", name, error)  # fmt: skip

    async def _open_or_read_only(self, stream: Stream) -> None:
        """Open the stream's next ledger, committing the recovered ends with it. Too few
        writable nodes for a new ensemble does not keep the stream from its readers: the
        recovery needed only the nodes that are there, so the recovered ends are committed
        alone and the stream is served read-only. Its last ledger is closed, so the next
        append opens a new one (503 not_enough_nodes until the nodes come back); no add of
        the old owner can land anywhere meanwhile: its ledgers are fenced and closed."""
        try:
            await self._manager.open_ledger(stream.name)
        except StreamNotEnoughNodes as error:
            await self._manager.save(stream.name)
            log.warning("stream %s taken over read-only: %s; appends open its next ledger "
                        "once enough nodes are writable", stream.name, error)  # fmt: skip

    async def _settle_ends(self, stream: Stream) -> bool:
        """Fence and recover the ledgers whose end the record may not hold, and take their
        ends from the recovery; whether anything changed (the caller commits the record).

        Those are the last ledger, when OPEN, and every one the record says is ``closing``:
        a rollover writes the record naming the new ledger first and closes the old one in
        the metadata store only once its adds in flight settled, so an owner that dies
        between (or whose close failed) leaves the old ledger OPEN there, with acknowledged
        entries past the count the record has. The one before the last is recovered in any
        case (records written before ``closing`` existed). Recovering a CLOSED ledger only
        reads its metadata."""
        changed = False
        earlier = [info for info in stream.ledgers[:-2] if info.closing]
        for info in [*earlier, *stream.ledgers[-2:]]:
            if info.offload is not None:
                continue  # closed, with its count, before its offload began (maybe no replica left)
            try:
                meta = await self._client.recover_ledger(info.ledger_id)
            except ClientRecoveryFailed as error:
                raise RecoveryFailed(f"stream {stream.name}: {error}") from None
            except NoSuchLedger:
                if info.entries or info is not stream.ledgers[-1]:
                    raise
                # A rollover whose record went in but whose ledger did not: it took no add.
                stream.ledgers.pop()
                changed = True
                continue
            end = (meta["lastEntryId"] + 1, meta["length"])
            if (info.entries, info.size_bytes) != end or not info.closed_ms or info.closing:
                info.entries, info.size_bytes = end
                info.closed_ms = info.closed_ms or int(time.time() * 1000)
                info.closing = False
                changed = True
            self._backend.remember_closed(info.ledger_id, meta["lastEntryId"], meta["length"])
        return changed

    def summary(self) -> dict[str, int]:
        """The status page's figures of replicated streams on this node."""
        return {
            "streamsOwned": len(self._manager.streams()),
            "streamTakeovers": self.takeovers,
            "streamRequestsForwarded": self.forwarded,
        }

    async def until_owner_changes(self, name: str, url: str) -> None:
        """Returns once the owner key of ``name`` no longer names the node at ``url`` (its
        lease ended, or another node took the stream over), read every third of the lease
        (the owner's own keepalive pace). A forwarded request waits on this beside the
        owner's answer: a paused owner would otherwise hold it for the forward timeout,
        long after the stream could be taken over. A store that does not answer changes
        nothing here (the forward's own timeout still bounds the wait)."""
        interval = self._ownership.ttl_s / KEEPALIVES_PER_TTL
        while True:
            await asyncio.sleep(interval)
            try:
                owner = await self._ownership.owner(name)
                if owner is None:
                    return
                if (owner.url or await self._client.registry.url(owner.node)) != url:
                    return
            except (ClientError, ValueError) as error:
                log.debug("owner of stream %s not read (%s): the forward goes on", name, error)

    def forget_owner(self, name: str) -> None:
        """The owner read last did not serve the request (gone, or not the owner any more):
        the next one reads the owner key again."""
        self._owners.pop(name, None)

    async def elsewhere(self) -> list[tuple[Stream, str | None]]:
        """The streams of the metadata store this node does not serve, each with the node
        that does (None: no live owner; the next request takes it over)."""
        try:
            records = await self._store.range(STREAMS_KEY)
            owners = {
                key.removeprefix(OWNERS_PREFIX): json.loads(value.value)["node"]
                for key, value in await self._store.range(OWNERS_PREFIX)
            }
        except MetadataError as error:
            raise MetadataUnavailable(f"the metadata store did not answer: {error}") from None
        found = []
        for key, value in records:
            name = key.removeprefix(STREAMS_KEY)
            if not self.owns(name):
                found.append((Stream.decode(value.value), owners.get(name)))
        return found

    async def take_over_unowned(self) -> list[str]:
        """Take over every stream of the metadata store that no live node owns (its owner
        died and no request came since): the retention and offload runs do this first, so
        that a run on every node (the DAGs') reaches every stream, not only the ones clients
        keep asking for. Concurrent runs on several nodes race through the ownership key:
        one takes each stream, the others see its owner. A stream that cannot be taken now
        (too few writable nodes for its new ledger, the store failing) is logged and left
        for the next run; the names taken."""
        taken: list[str] = []
        try:
            others = await self.elsewhere()
        except MetadataUnavailable as error:
            log.warning("streams without a live owner not looked for: %s", error)
            return taken  # the run goes on with the streams this node owns
        for stream, owner in others:
            if owner is not None:
                continue
            try:
                if await self.route(stream.name) is None:
                    taken.append(stream.name)
            except (StorageError, ClientError) as error:
                log.warning("stream %s has no live owner and could not be taken over for "
                            "its lifecycle now (the next run tries again): %s",
                            stream.name, error)  # fmt: skip
        return taken

    def lost(self, names: list[str]) -> None:
        """The ownership of ``names`` is gone (the lease expired, or a commit found another
        owner): stop serving them here."""
        for name in names:
            self._manager.drop(name)
            self._backend.forget_stream(name)
            log.warning("stream %s: ownership lost; another node serves it", name)

    async def release(self, name: str) -> None:
        """After a deletion: the name is free for whoever creates it next."""
        self._manager.drop(name)
        self._backend.forget_stream(name)
        with contextlib.suppress(Exception):
            await self._ownership.release(name)


def replicated_streams(
    settings: Settings,
    store: MetadataStore,
    clock: Clock,
    token: str | None,
    transport: Callable[[Transport], Transport] | None = None,
) -> tuple[StreamManager, StreamRouter]:
    """A node's streams when it has a metadata store: a manager over replicated ledgers whose
    streams are the ones this node owns, and the router that decides which those are.
    ``transport`` wraps the client's HTTP transport (the node's own replica adds, locally)."""
    client = Client(store, token=token, home_node=settings.id)
    if transport is not None:
        client.transport = transport(client.transport)
    ownership = Ownership(store, settings.id, settings.advertised_url, settings.stream_owner_ttl_s)
    backend = ReplicatedBackend(
        settings, client, store, ownership, lambda name: _replication(manager, name)
    )
    manager = StreamManager(backend, clock)
    manager.cache = EntryCache(settings.stream_entry_cache_bytes)
    manager.default_replication = Replication(
        settings.stream_ensemble_size, settings.stream_write_quorum, settings.stream_ack_quorum
    )
    router = StreamRouter(
        settings.id, manager, backend, ownership, client, settings.stream_owner_cache_ms / 1000
    )
    ownership.on_lost = router.lost
    return manager, router


def _replication(manager: StreamManager, name: str) -> Replication:
    replication = manager.stream(name).replication or manager.default_replication
    assert replication is not None  # a replicated node's manager always has its default
    return replication
