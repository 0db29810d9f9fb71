"""The write cache and the read cache (BookKeeper's WriteCache and ReadCache).

Both live on the event loop thread only. A write cache that has been swapped out for a
checkpoint is frozen (nothing writes to it any more), so the checkpoint thread may read it
while the loop keeps serving reads from it; ``WriteCaches`` holds the two.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from node.storage.entrylog import LedgerEntries
from node.storage.logformat import RECORD_OVERHEAD


class WriteCache:
    """Entries added since the last swap, by ledger then entry id."""

    __slots__ = ("_ledgers", "count", "size")

    def __init__(self) -> None:
        self._ledgers: dict[int, dict[int, tuple[int, bytes]]] = {}
        self.size = 0  # bytes as they will take in the entry log
        self.count = 0

    def put(self, ledger_id: int, entry_id: int, crc: int, payload: bytes) -> None:
        entries = self._ledgers.get(ledger_id)
        if entries is None:
            entries = self._ledgers[ledger_id] = {}
        previous = entries.get(entry_id)
        if previous is None:
            self.count += 1
            self.size += RECORD_OVERHEAD + len(payload)
        else:
            self.size += len(payload) - len(previous[1])
        entries[entry_id] = (crc, payload)

    def put_batch(
        self, ledger_id: int, first_entry_id: int, crcs: Sequence[int], payloads: list[bytes]
    ) -> None:
        """Entries at consecutive ids, none of them cached yet (a batch's fresh ids)."""
        entries = self._ledgers.get(ledger_id)
        if entries is None:
            entries = self._ledgers[ledger_id] = {}
        ids = range(first_entry_id, first_entry_id + len(payloads))
        assert entries.keys().isdisjoint(ids), "a batch's ids are cached already"
        entries.update(zip(ids, zip(crcs, payloads, strict=True), strict=True))
        self.count += len(payloads)
        self.size += RECORD_OVERHEAD * len(payloads) + sum(map(len, payloads))

    def get(self, ledger_id: int, entry_id: int) -> bytes | None:
        entries = self._ledgers.get(ledger_id)
        if entries is None:
            return None
        found = entries.get(entry_id)
        return None if found is None else found[1]

    def entry_ids(self, ledger_id: int) -> list[int]:
        return sorted(self._ledgers.get(ledger_id, ()))

    def highest_entry_id(self, ledger_id: int) -> int:
        """The highest entry id cached for the ledger, -1 if none."""
        return max(self._ledgers.get(ledger_id, ()), default=-1)

    def remove(self, ledger_id: int, entry_id: int) -> None:
        """Drop an entry whose add failed (on the loop, never while a checkpoint reads)."""
        entries = self._ledgers.get(ledger_id)
        found = None if entries is None else entries.pop(entry_id, None)
        if found is None:
            return
        self.count -= 1
        self.size -= RECORD_OVERHEAD + len(found[1])
        if not entries:
            del self._ledgers[ledger_id]

    def __len__(self) -> int:
        return self.count

    def sorted_ledgers(self, skip: frozenset[int] = frozenset()) -> list[LedgerEntries]:
        """Per ledger, by ledger id: (ledger id, its entry ids sorted, its entries by id),
        so that a ledger's entries land contiguous and in order in the entry log (read-ahead
        relies on it). Ledgers in ``skip`` (deleted since they were cached) are left out."""
        return [
            (ledger_id, sorted(entries), entries)
            for ledger_id, entries in sorted(self._ledgers.items())
            if ledger_id not in skip
        ]

    def sorted_entries(
        self, skip: frozenset[int] = frozenset()
    ) -> Iterator[tuple[int, int, int, bytes]]:
        """(ledger id, entry id, crc, payload) in the order of ``sorted_ledgers``."""
        for ledger_id, entry_ids, entries in self.sorted_ledgers(skip):
            for entry_id in entry_ids:
                crc, payload = entries[entry_id]
                yield ledger_id, entry_id, crc, payload


class WriteCaches:
    """The write cache adds go to (``current``) and the frozen one a checkpoint (or
    replay) is flushing (``flushing``, None between flushes): an entry added and not yet
    in an entry log is in one of the two."""

    __slots__ = ("current", "flushing")

    def __init__(self) -> None:
        self.current = WriteCache()
        self.flushing: WriteCache | None = None

    def freeze(self) -> WriteCache:
        """Swap in an empty cache; the old one is frozen and ``flushing`` until
        ``flushed``."""
        frozen, self.current = self.current, WriteCache()
        self.flushing = frozen
        return frozen

    def flushed(self) -> None:
        self.flushing = None

    def get(self, ledger_id: int, entry_id: int) -> bytes | None:
        found = self.current.get(ledger_id, entry_id)
        if found is None and self.flushing is not None:
            found = self.flushing.get(ledger_id, entry_id)
        return found

    def put_back(self, frozen: WriteCache, skip: frozenset[int] = frozenset()) -> None:
        """Merge a frozen cache whose flush failed back into the current one (an entry
        cached again since is newer and stays), so that reads still find its entries."""
        current = self.current
        for lid, eid, crc, payload in frozen.sorted_entries(skip):
            if current.get(lid, eid) is None:
                current.put(lid, eid, crc, payload)

    def highest_entry_id(self, ledger_id: int) -> int:
        """The highest entry id of the ledger in either cache, -1 if none."""
        flushing = self.flushing.highest_entry_id(ledger_id) if self.flushing else -1
        return max(self.current.highest_entry_id(ledger_id), flushing)

    def remove(self, ledger_id: int, entry_id: int, payload: bytes) -> None:
        """Drop ``payload`` (these very bytes, not an entry cached again since) from both."""
        for cache in (self.current, self.flushing):
            if cache is not None and cache.get(ledger_id, entry_id) is payload:
                cache.remove(ledger_id, entry_id)

    @property
    def size(self) -> int:
        return self.current.size + (self.flushing.size if self.flushing else 0)


class ReadCache:
    """A ring of segments: new entries go to the current segment; when it is full the ring
    moves on and the oldest segment is cleared whole (no per-entry LRU bookkeeping)."""

    __slots__ = ("_current", "_segment_size", "_segments", "_sizes", "hits", "misses")

    def __init__(self, max_size: int, segments: int) -> None:
        self._segment_size = max(1, max_size // segments)
        self._segments: list[dict[tuple[int, int], bytes]] = [{} for _ in range(segments)]
        self._sizes = [0] * segments
        self._current = 0
        self.hits = 0
        self.misses = 0

    def put(self, ledger_id: int, entry_id: int, payload: bytes) -> None:
        length = len(payload)
        if length > self._segment_size:
            for segment in self._segments:  # never leave an older value to be found
                segment.pop((ledger_id, entry_id), None)
            return
        if self._sizes[self._current] + length > self._segment_size:
            self._current = (self._current + 1) % len(self._segments)
            self._segments[self._current].clear()
            self._sizes[self._current] = 0
        self._segments[self._current][(ledger_id, entry_id)] = payload
        self._sizes[self._current] += length

    def get(self, ledger_id: int, entry_id: int) -> bytes | None:
        key = (ledger_id, entry_id)
        n = len(self._segments)
        for step in range(n):
            found = self._segments[(self._current - step) % n].get(key)
            if found is not None:
                self.hits += 1
                return found
        self.misses += 1
        return None

    def __contains__(self, key: tuple[int, int]) -> bool:
        """Without counting a hit or a miss. Safe from a reader thread: a dict lookup is
        atomic, and a stale answer only ends a read-ahead early or late."""
        return any(key in segment for segment in self._segments)

    @property
    def size(self) -> int:
        return sum(self._sizes)
