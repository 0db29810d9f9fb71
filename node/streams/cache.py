"""The owner's cache of the entries it appended (Pulsar's managed-ledger ``EntryCache``): a
tailing reader of a replicated stream is answered from memory, without a request to a
replica. Only acknowledged entries go in (the manager puts an append's entries after its
add returned), so the cache never serves what the ledger may not keep.

Bounded by bytes (``stream_entry_cache_bytes``): the oldest entries put go first. Entries
every cursor of their stream has acknowledged go at once (Pulsar evicts behind the slowest
cursor), and a ledger's entries go with the ledger (trimmed, deleted, the stream moved).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class CacheStats:
    hits: int = 0  # entries a read took from the cache
    misses: int = 0  # entries a read took from the ledger instead (its replicas)
    evicted: int = 0  # entries dropped to stay within the bound


class EntryCache:
    """(ledger id, entry id) -> payload; ``max_bytes`` 0 keeps nothing. Per ledger in the
    order put (ids ascending: a stream's appends are acknowledged in order), ledgers in the
    order first put, so evicting the oldest and dropping a read prefix cost what they drop."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size_bytes = 0
        self.stats = CacheStats()
        self._ledgers: OrderedDict[int, dict[int, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return sum(map(len, self._ledgers.values()))

    def put(self, ledger_id: int, first: int, payloads: list[bytes]) -> None:
        """The entries ``first``.. of ``ledger_id``, acknowledged."""
        if not self.max_bytes:
            return
        entries = self._ledgers.get(ledger_id)
        if entries is None:
            entries = self._ledgers[ledger_id] = {}
        for offset, payload in enumerate(payloads):
            if first + offset not in entries:
                entries[first + offset] = payload
                self.size_bytes += len(payload)
        while self.size_bytes > self.max_bytes:
            oldest_ledger, oldest = next(iter(self._ledgers.items()))
            self.size_bytes -= len(oldest.pop(next(iter(oldest))))
            self.stats.evicted += 1
            if not oldest:
                del self._ledgers[oldest_ledger]

    def get(self, ledger_id: int, entry_id: int) -> bytes | None:
        """The payload if cached (a hit); the caller counts the misses it reads elsewhere."""
        entries = self._ledgers.get(ledger_id)
        payload = None if entries is None else entries.get(entry_id)
        if payload is not None:
            self.stats.hits += 1
        return payload

    def drop_through(self, ledger_id: int, entry_id: int) -> None:
        """Forget ``ledger_id``'s entries up to ``entry_id`` (every cursor read them)."""
        entries = self._ledgers.get(ledger_id)
        while entries:
            first = next(iter(entries))
            if first > entry_id:
                return
            self.size_bytes -= len(entries.pop(first))
        self._ledgers.pop(ledger_id, None)

    def drop_ledgers(self, ledger_ids: set[int]) -> None:
        """Forget every entry of these ledgers (trimmed, deleted, or no longer served)."""
        for ledger_id in ledger_ids:
            entries = self._ledgers.pop(ledger_id, None)
            if entries is not None:
                self.size_bytes -= sum(map(len, entries.values()))
