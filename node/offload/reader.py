"""Reads of offloaded ledgers (the engine's cold reader).

An entry is found through the ledger's index object (fetched once, kept for
``offload_index_cache_ledgers`` ledgers): the index point at or before it names a span of
at most the stride (``managed_ledger_offload_read_buffer_size_in_bytes``, 1 MiB), fetched
with one ranged GET and checked against its CRC before any byte of it is served. Spans are
kept in a block cache bounded in bytes (``offload_block_cache_size``); a read that follows
the previous one in order starts fetching the next ``managed_ledger_offload_prefetch_rounds``
spans, so a sequential reader rarely waits on the store. A missing or damaged object is an
``offload_object_unreadable`` error naming the object (502), never wrong bytes; a store
that fails is an ``offload_store_*`` error (502, 503, 504). Both count as refused reads.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from node.offload.errors import ObjectStoreError, OffloadObjectUnreadable
from node.offload.format import FormatError, LedgerIndex, data_key, decode_span, index_key
from node.offload.stats import OffloadStats
from node.offload.store import ObjectMissing, ObjectStore, ObjectTooShort
from node.settings import Settings
from node.storage.clock import Clock
from node.storage.errors import EntryNotFound
from node.storage.index import LedgerMeta

log = logging.getLogger(__name__)

SpanKey = tuple[int, str, int]  # ledger id, attempt, index point


class OffloadReader:
    def __init__(
        self, store: ObjectStore, settings: Settings, clock: Clock, stats: OffloadStats
    ) -> None:
        self.store = store
        self._settings = settings
        self._clock = clock
        self._stats = stats
        self._indexes: OrderedDict[tuple[int, str], LedgerIndex] = OrderedDict()
        self._spans: OrderedDict[SpanKey, dict[int, bytes]] = OrderedDict()
        self._span_sizes: dict[SpanKey, int] = {}
        self._cached_bytes = 0
        self._fetching: dict[SpanKey, asyncio.Task[dict[int, bytes]]] = {}
        self._index_fetching: dict[tuple[int, str], asyncio.Task[LedgerIndex]] = {}
        self._last_point: dict[int, int] = {}  # ledger id -> span of its previous read

    async def read(self, meta: LedgerMeta, entry_id: int) -> bytes:
        try:
            return await self._read(meta, entry_id)
        except (OffloadObjectUnreadable, ObjectStoreError):
            self._stats.unreadable_objects += 1  # a read refused: the alert's metric
            raise

    async def _read(self, meta: LedgerMeta, entry_id: int) -> bytes:
        offload = meta.offload
        assert offload is not None and offload.offloaded
        lid, attempt = meta.ledger_id, offload.attempt
        index = await self._index(lid, attempt)
        point = index.point_of(entry_id)
        if point < 0:
            raise EntryNotFound(f"entry {entry_id} of ledger {lid} does not exist")
        key = (lid, attempt, point)
        entries = self._spans.get(key)
        if entries is None:
            self._stats.cache_misses += 1
            entries = await self._span(index, key)
        else:
            self._stats.cache_hits += 1
            self._spans.move_to_end(key)
        previous = self._last_point.get(lid)
        self._last_point[lid] = point
        if previous is not None and previous in (point - 1, point):
            self._prefetch(index, lid, attempt, point)
        payload = entries.get(entry_id)
        if payload is None:
            raise OffloadObjectUnreadable(
                f"offloaded object {data_key(lid, attempt)} of {self.store.description} "
                f"lacks entry {entry_id} where its index puts it"
            )
        return payload

    def forget(self, ledger_id: int) -> None:
        """Drop what is cached of a ledger (deleted, or its objects replaced)."""
        for key in [k for k in self._indexes if k[0] == ledger_id]:
            del self._indexes[key]
        for span in [k for k in self._spans if k[0] == ledger_id]:
            self._drop_span(span)
        self._last_point.pop(ledger_id, None)

    # --- the index object -------------------------------------------------------------------

    async def _index(self, lid: int, attempt: str) -> LedgerIndex:
        found = self._indexes.get((lid, attempt))
        if found is not None:
            self._indexes.move_to_end((lid, attempt))
            return found
        task = self._index_fetching.get((lid, attempt))
        if task is None:
            task = asyncio.create_task(self._fetch_index(lid, attempt))
            self._index_fetching[(lid, attempt)] = task
            task.add_done_callback(lambda _t: self._index_fetching.pop((lid, attempt), None))
        return await asyncio.shield(task)

    async def _fetch_index(self, lid: int, attempt: str) -> LedgerIndex:
        key = index_key(lid, attempt)
        started = self._clock.monotonic()
        try:
            data = await self.store.get(key)
            index = LedgerIndex.decode(data)
            if index.ledger_id != lid:
                raise FormatError(f"it indexes ledger {index.ledger_id}")
        except (ObjectMissing, ObjectTooShort, FormatError) as e:
            raise self._unreadable(key, e) from e
        self._stats.object_read(self._clock.monotonic() - started, len(data))
        self._indexes[(lid, attempt)] = index
        while len(self._indexes) > self._settings.offload_index_cache_ledgers:
            self._indexes.popitem(last=False)
        return index

    # --- spans of the data object ------------------------------------------------------------

    async def _span(self, index: LedgerIndex, key: SpanKey) -> dict[int, bytes]:
        task = self._fetching.get(key)
        if task is None:
            task = self._start_fetch(index, key)
        return await asyncio.shield(task)

    def _start_fetch(self, index: LedgerIndex, key: SpanKey) -> asyncio.Task[dict[int, bytes]]:
        task = asyncio.create_task(self._fetch_span(index, key))
        self._fetching[key] = task
        task.add_done_callback(lambda _t: self._fetching.pop(key, None))
        return task

    def _prefetch(self, index: LedgerIndex, lid: int, attempt: str, point: int) -> None:
        rounds = self._settings.managed_ledger_offload_prefetch_rounds
        for ahead in range(point + 1, min(point + 1 + rounds, len(index.points))):
            key = (lid, attempt, ahead)
            if key in self._spans or key in self._fetching:
                continue
            self._stats.prefetches += 1
            task = self._start_fetch(index, key)
            # A failed prefetch is reported by the read that needs the span, if any.
            task.add_done_callback(_consume_error)

    async def _fetch_span(self, index: LedgerIndex, key: SpanKey) -> dict[int, bytes]:
        lid, attempt, point_no = key
        point = index.points[point_no]
        object_key = data_key(lid, attempt)
        started = self._clock.monotonic()
        try:
            data = await self.store.get_range(object_key, point.offset, point.length)
            entries = decode_span(data, point, object_key)
        except (ObjectMissing, ObjectTooShort, FormatError) as e:
            raise self._unreadable(object_key, e) from e
        self._stats.object_read(self._clock.monotonic() - started, len(data))
        self._keep(key, entries, len(data))
        return entries

    def _keep(self, key: SpanKey, entries: dict[int, bytes], size: int) -> None:
        limit = self._settings.offload_block_cache_size
        if size > limit or key in self._spans:
            return
        self._spans[key] = entries
        self._span_sizes[key] = size
        self._cached_bytes += size
        while self._cached_bytes > limit:
            self._drop_span(next(iter(self._spans)))

    def _drop_span(self, key: SpanKey) -> None:
        del self._spans[key]
        self._cached_bytes -= self._span_sizes.pop(key)

    def _unreadable(self, key: str, error: Exception) -> OffloadObjectUnreadable:
        reason = "it does not exist" if isinstance(error, ObjectMissing) else str(error)
        log.error(
            "offloaded object %s of %s is unreadable: %s", key, self.store.description, reason
        )
        return OffloadObjectUnreadable(
            f"offloaded object {key} of {self.store.description} is unreadable: {reason}"
        )

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes


def _consume_error(task: asyncio.Task[dict[int, bytes]]) -> None:
    if not task.cancelled():
        task.exception()
