"""The owner's cache of the entries it appended (Pulsar's managed-ledger ``EntryCache``): a
tailing reader of a replicated stream is answered from memory, without a request to a
replica. Only acknowledged entries go in (the manager puts an append's entries after its
add returned), so the cache never serves what the ledger may not keep.

Bounded by bytes (``stream_entry_cache_bytes``): the lowest ids of the ledger first put go
first. Entries
every cursor of their stream has acknowledged go at once (Pulsar evicts behind the slowest
cursor), and a ledger's entries go with the ledger (trimmed, deleted, the stream moved).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class CacheStats:
    hits: int = 0  # entries a read took from the cache
    misses: int = 0  # entries a read took from the ledger instead (its replicas)
    evicted: int = 0  # entries dropped to stay within the bound


class _Ledger:
    """One ledger's cached entries: a map for reads, a heap of their ids for dropping the
    lowest (a cursor's acknowledged prefix, eviction). Neither walks the map from its front:
    a dict emptied from the front leaves holes that every later look for its first key walks
    again (a cursor's acknowledgment of 10,000 entries held the event loop 70 ms)."""

    __slots__ = ("entries", "ids")

    def __init__(self) -> None:
        self.entries: dict[int, bytes] = {}
        self.ids: list[int] = []  # a heap: the lowest id first

    def pop_lowest(self) -> bytes:
        return self.entries.pop(heapq.heappop(self.ids))


class EntryCache:
    """(ledger id, entry id) -> payload; ``max_bytes`` 0 keeps nothing. Ledgers in the order
    first put; within one, the lowest ids go first (evicted, or dropped behind the cursors),
    whatever the order they were put in (a read-ahead may fill in behind a writer's tail).
    Every operation costs what it puts or drops, times a heap step."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size_bytes = 0
        self.stats = CacheStats()
        self._ledgers: OrderedDict[int, _Ledger] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(ledger.entries) for ledger in self._ledgers.values())

    def put(self, ledger_id: int, first: int, payloads: list[bytes]) -> None:
        """The entries ``first``.. of ``ledger_id``, acknowledged."""
        if not self.max_bytes:
            return
        ledger = self._ledgers.get(ledger_id)
        if ledger is None:
            ledger = self._ledgers[ledger_id] = _Ledger()
        entries, ids = ledger.entries, ledger.ids
        for entry_id, payload in enumerate(payloads, first):
            if entry_id not in entries:
                entries[entry_id] = payload
                heapq.heappush(ids, entry_id)
                self.size_bytes += len(payload)
        while self.size_bytes > self.max_bytes:
            oldest_id, oldest = next(iter(self._ledgers.items()))
            self.size_bytes -= len(oldest.pop_lowest())
            self.stats.evicted += 1
            if not oldest.ids:
                del self._ledgers[oldest_id]

    def get(self, ledger_id: int, entry_id: int) -> bytes | None:
        """The payload if cached (a hit); the caller counts the misses it reads elsewhere."""
        ledger = self._ledgers.get(ledger_id)
        payload = None if ledger is None else ledger.entries.get(entry_id)
        if payload is not None:
            self.stats.hits += 1
        return payload

    def drop_through(self, ledger_id: int, entry_id: int) -> None:
        """Forget ``ledger_id``'s entries up to ``entry_id`` (every cursor read them)."""
        ledger = self._ledgers.get(ledger_id)
        if ledger is None:
            return
        ids = ledger.ids
        while ids and ids[0] <= entry_id:
            self.size_bytes -= len(ledger.pop_lowest())
        if not ids:
            del self._ledgers[ledger_id]

    def drop_ledgers(self, ledger_ids: set[int]) -> None:
        """Forget every entry of these ledgers (trimmed, deleted, or no longer served)."""
        for ledger_id in ledger_ids:
            ledger = self._ledgers.pop(ledger_id, None)
            if ledger is not None:
                self.size_bytes -= sum(map(len, ledger.entries.values()))
