"""The Client: ledgers created, opened, recovered and deleted through the metadata store;
writing is LedgerHandle's (writer.py), reading ReadHandle's (reader.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
import uuid
import weakref
from collections.abc import Coroutine, Mapping
from types import TracebackType
from typing import Any, TypeVar

from node.client.bookies import BookieClient, Transport
from node.client.errors import (
    CasConflict,
    ClientError,
    NoSuchKey,
    NoSuchLedger,
    OutcomeUnknown,
    ReadFailed,
    StoreUnavailable,
)
from node.client.metadata.loop import read_with_retry
from node.client.metadata.store import MetadataStore, Versioned
from node.client.model import (
    LEDGERS_PREFIX,
    LedgerMetadata,
    Segment,
    decode,
    encode,
    ledger_id_of,
    ledger_key,
)
from node.client.placement import choose_ensemble
from node.client.reader import ReadHandle, lac_of, read_lac_coverage
from node.client.recovery import PhaseHook, recover
from node.client.registry import Registry
from node.client.writer import LedgerHandle

log = logging.getLogger(__name__)
T = TypeVar("T")

# A replica add without an answer in this time counts as that node's failure (ensemble change).
DEFAULT_ADD_TIMEOUT_S = 10.0
# One replica's read (entry or LAC) before the reader tries the next one.
DEFAULT_READ_TIMEOUT_S = 10.0
# A replica's read unanswered this long: the next replica is asked too (BookKeeper's
# speculative read timeout).
DEFAULT_SPECULATIVE_READ_S = 2.0
# Each step of a recovery (covering LAC answers, one entry's reads, one re-add).
DEFAULT_RECOVERY_TIMEOUT_S = 15.0
# Entries whose recovery reads go out ahead of the entry being decided.
DEFAULT_RECOVERY_READ_WINDOW = 64
# Ensemble changes one writer may make before it gives the ledger up.
DEFAULT_MAX_ENSEMBLE_CHANGES = 50
# Entries a reader asks one replica for in one range request (the node's
# max_read_reply_bytes cuts a reply of large entries; the reader reads on from the cut).
DEFAULT_READ_RANGE_ENTRIES = 1024
# Ranges a reader has in flight: the next one is on its way while the caller takes one.
DEFAULT_READ_AHEAD_RANGES = 2
# The largest payload an add accepts (the node's max_entry_size default): larger is AddFailed.
DEFAULT_MAX_ENTRY_SIZE = 5 * 1024 * 1024
# Payload bytes in one replica add request (a node refuses bodies over its max_request_size).
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
# Entries in one replica add request (the node's max_entries_per_batch default).
DEFAULT_MAX_REQUEST_ENTRIES = 10_000
# Replica add requests a writer keeps out per node: adds made while that many are out wait
# for one to answer and go together (fewer, larger requests under concurrent adds).
DEFAULT_ADDS_IN_FLIGHT_PER_NODE = 1
# The metadata store's per-request time (an etcd:// URL the client opens itself).
DEFAULT_METADATA_TIMEOUT_S = 5.0
# Attempts at a create whose answer was lost before the caller hears of it.
CREATE_ATTEMPTS = 5


class Client:
    """A client of replicated ledgers: ``store`` is an ``etcd://`` URL (the client opens and
    closes it) or a MetadataStore (the caller's). ``address_override`` maps node ids to base
    URLs used instead of the registered ones; ``transport`` replaces HTTP (the simulation);
    ``token`` is the nodes' admin token (NODE_ADMIN_TOKEN), sent with every request."""

    def __init__(
        self,
        store: str | MetadataStore,
        *,
        address_override: Mapping[str, str] | None = None,
        transport: Transport | None = None,
        add_timeout_s: float = DEFAULT_ADD_TIMEOUT_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        speculative_read_s: float = DEFAULT_SPECULATIVE_READ_S,
        recovery_timeout_s: float = DEFAULT_RECOVERY_TIMEOUT_S,
        recovery_read_window: int = DEFAULT_RECOVERY_READ_WINDOW,
        max_ensemble_changes: int = DEFAULT_MAX_ENSEMBLE_CHANGES,
        read_range_entries: int = DEFAULT_READ_RANGE_ENTRIES,
        read_ahead_ranges: int = DEFAULT_READ_AHEAD_RANGES,
        max_entry_size: int = DEFAULT_MAX_ENTRY_SIZE,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_request_entries: int = DEFAULT_MAX_REQUEST_ENTRIES,
        adds_in_flight_per_node: int = DEFAULT_ADDS_IN_FLIGHT_PER_NODE,
        metadata_timeout_s: float = DEFAULT_METADATA_TIMEOUT_S,
        rng: random.Random | None = None,
        token: str | None = None,
        home_node: str | None = None,
        _unsafe_unfenced_recovery_reads: bool = False,
    ) -> None:
        if isinstance(store, str):
            from node.client.metadata.etcd import EtcdStore

            self.store: MetadataStore = EtcdStore(store, timeout_s=metadata_timeout_s)
            self._owns_store = True
        else:
            self.store = store
            self._owns_store = False
        self.registry = Registry(self.store, address_override)
        self.transport: Transport = transport or BookieClient(self.registry, token=token)
        self.add_timeout_s = add_timeout_s
        self.read_timeout_s = read_timeout_s
        self.speculative_read_s = speculative_read_s
        self.recovery_timeout_s = recovery_timeout_s
        self.recovery_read_window = recovery_read_window
        self.max_ensemble_changes = max_ensemble_changes
        self.read_range_entries = read_range_entries
        self.read_ahead_ranges = read_ahead_ranges
        self.max_entry_size = max_entry_size
        self.max_request_bytes = max_request_bytes
        self.max_request_entries = max_request_entries
        self.adds_in_flight_per_node = adds_in_flight_per_node
        self.rng = rng or random.Random()
        # The node this client runs inside, if any: its replica is read first (a read of its
        # own storage when the transport serves that node locally: node.replication.local).
        self.home_node = home_node
        # Test-only: recovery's entry reads without fence=1 (BookKeeper #2614 comes back).
        self.unsafe_unfenced_recovery_reads = _unsafe_unfenced_recovery_reads
        self._tasks: set[asyncio.Task[Any]] = set()
        self._handles: weakref.WeakSet[LedgerHandle] = weakref.WeakSet()  # writers to settle
        self.closed = False

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop every request still out (late replica adds, fences), close the transport and an
        owned store. Adds in flight end AddOutcomeUnknown (``client_closed``): they were sent,
        and the ledgers stay OPEN (a recovery decides)."""
        self.closed = True
        for handle in list(self._handles):
            handle._client_closed()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.transport.close()
        if self._owns_store:
            await self.store.close()

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A background request of this client, cancelled by close()."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            if not isinstance(error, ClientError):
                log.error("client task failed", exc_info=error)

    async def create_ledger(
        self,
        ensemble: int = 3,
        write_quorum: int = 3,
        ack_quorum: int = 2,
        properties: Mapping[str, str] | None = None,
    ) -> LedgerHandle:
        """A new OPEN ledger on ``ensemble`` distinct writable nodes (distinct zones when there
        are enough; the home node first when it is writable), written by the returned handle."""
        candidates = await self.registry.candidates()
        nodes = choose_ensemble(candidates, ensemble, self.rng, home=self.home_node)
        ledger_id = await self._retry(self.store.next_id)
        meta = LedgerMetadata(
            ledger_id=ledger_id,
            ensemble_size=ensemble,
            write_quorum=write_quorum,
            ack_quorum=ack_quorum,
            segments=(Segment(0, tuple(nodes)),),
            ctime_ms=int(time.time() * 1000),
            creator=f"{socket.gethostname()}/pid {os.getpid()}/{uuid.uuid4().hex}",
            properties=dict(properties or {}),
        )
        return LedgerHandle(self, await self._create(meta))

    async def _retry(self, call: Any) -> Any:
        for attempt in range(1, CREATE_ATTEMPTS + 1):
            try:
                return await call()
            except (StoreUnavailable, OutcomeUnknown):
                if attempt == CREATE_ATTEMPTS:
                    raise
                await asyncio.sleep(0.2 * attempt)

    async def _create(self, meta: LedgerMetadata) -> Versioned:
        """Create the key; a lost answer is resolved by the creator nonce in the value."""
        key, value = ledger_key(meta.ledger_id), encode(meta)
        for attempt in range(1, CREATE_ATTEMPTS + 1):
            try:
                return await self.store.create(key, value)
            except (StoreUnavailable, OutcomeUnknown):
                if attempt == CREATE_ATTEMPTS:
                    raise
                found = await read_with_retry(self.store, key)
                if found is not None:
                    if decode(found.value).creator == meta.creator:
                        return found
                    raise ClientError(f"{key}: created by someone else") from None
        raise AssertionError("unreachable")

    async def _read(self, ledger_id: int) -> Versioned:
        found = await read_with_retry(self.store, ledger_key(ledger_id))
        if found is None:
            raise NoSuchLedger(ledger_id)
        return found

    async def ledger_metadata(self, ledger_id: int) -> dict[str, Any]:
        """BookKeeper's fields of the ledger's metadata, plus ``revision`` (of the store)."""
        found = await self._read(ledger_id)
        return {**decode(found.value).to_json(), "revision": found.revision}

    async def ledgers(self) -> list[int]:
        """Every ledger id in the store, ascending."""
        return [ledger_id_of(key) for key, _ in await self.store.range(LEDGERS_PREFIX)]

    async def open_ledger(self, ledger_id: int, *, recover: bool = False) -> ReadHandle:
        """A reader. ``recover=True`` fences and recovers an OPEN ledger (it ends CLOSED);
        without it nothing is fenced and an OPEN ledger is read up to its LAC."""
        found = await self._read(ledger_id)
        if recover:
            found = await self._recover(ledger_id)
        meta = decode(found.value)
        lac = meta.last_entry_id
        if not meta.closed:
            answers = await read_lac_coverage(
                self, meta, fence=False, timeout_s=self.read_timeout_s, failure=ReadFailed
            )
            lac = lac_of(meta, answers)
        return ReadHandle(self, meta, lac)

    async def _recover(self, ledger_id: int, on_phase: PhaseHook | None = None) -> Versioned:
        return await recover(self, ledger_id, on_phase)

    async def recover_ledger(
        self, ledger_id: int, on_phase: PhaseHook | None = None
    ) -> dict[str, Any]:
        """Fence and recover the ledger; its metadata once CLOSED (as ``ledger_metadata``).
        ``on_phase`` (tests) is awaited at "in_recovery", "lac_read", each "entry", "close"."""
        found = await self._recover(ledger_id, on_phase)
        return {**decode(found.value).to_json(), "revision": found.revision}

    async def delete_ledger(self, ledger_id: int) -> None:
        """Delete the ledger's metadata; the nodes reclaim their replicas on their own once they
        see it gone. NoSuchLedger when it is not there."""
        key = ledger_key(ledger_id)
        current = await self._read(ledger_id)
        while True:
            try:
                await self.store.delete(key, current.revision)
                return
            except CasConflict as conflict:
                current = conflict.current or await self._read(ledger_id)
            except NoSuchKey:
                raise NoSuchLedger(ledger_id) from None
            except (StoreUnavailable, OutcomeUnknown):
                found = await read_with_retry(self.store, key)
                if found is None:
                    return  # the lost answer was a delete that went in
                current = found
