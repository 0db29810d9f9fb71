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
    """(ledger id, entry id) -> payload; ``max_bytes`` 0 keeps nothing. Per ledger ids
    ascending, ledgers in the order first put, so evicting the oldest and dropping a read
    prefix cost what they drop. The per-ledger maps are OrderedDicts: a plain dict emptied
    from its front leaves holes that every later look for its first key walks again (a
    cursor's acknowledgment of 10,000 cached entries took 70 ms of the event loop)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size_bytes = 0
        self.stats = CacheStats()
        self._ledgers: OrderedDict[int, OrderedDict[int, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return sum(map(len, self._ledgers.values()))

    def put(self, ledger_id: int, first: int, payloads: list[bytes]) -> None:
        """The entries ``first``.. of ``ledger_id``, acknowledged."""
        if not self.max_bytes or not payloads:
            return
        entries = self._ledgers.get(ledger_id)
        if entries is None:
            entries = self._ledgers[ledger_id] = OrderedDict()
        if not entries or first > next(reversed(entries)):  # after the rest: appends
            for offset, payload in enumerate(payloads):
                entries[first + offset] = payload
            self.size_bytes += sum(map(len, payloads))
        else:  # a read-ahead behind what is cached: merged in id order (seldom)
            for offset, payload in enumerate(payloads):
                if first + offset not in entries:
                    entries[first + offset] = payload
                    self.size_bytes += len(payload)
            self._ledgers[ledger_id] = OrderedDict(sorted(entries.items()))
        while self.size_bytes > self.max_bytes:
            oldest_ledger, oldest = next(iter(self._ledgers.items()))
            self.size_bytes -= len(oldest.popitem(last=False)[1])
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
        if entries is None:
            return
        count = 0
        for key in entries:  # ascending: the prefix to drop
            if key > entry_id:
                break
            count += 1
        pop = entries.popitem
        for _ in range(count):
            self.size_bytes -= len(pop(last=False)[1])
        if not entries:
            del self._ledgers[ledger_id]

    def drop_ledgers(self, ledger_ids: set[int]) -> None:
        """Forget every entry of these ledgers (trimmed, deleted, or no longer served)."""
        for ledger_id in ledger_ids:
            entries = self._ledgers.pop(ledger_id, None)
            if entries is not None:
                self.size_bytes -= sum(map(len, entries.values()))
