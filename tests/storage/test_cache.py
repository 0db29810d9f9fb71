"""Model-based property tests of the write cache and the read cache."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from node.storage.cache import ReadCache, WriteCache
from node.storage.logformat import RECORD_OVERHEAD
from node.storage.wal import record_crc

# Few ledgers and entries, so that overwrites of the same key are frequent.
KEYS = st.tuples(st.integers(0, 5), st.integers(0, 8))
PUTS = st.lists(st.tuples(KEYS, st.binary(max_size=64)), max_size=60)

# --- write cache ------------------------------------------------------------------------


def _fill(
    puts: list[tuple[tuple[int, int], bytes]],
) -> tuple[WriteCache, dict[tuple[int, int], tuple[int, bytes]]]:
    cache = WriteCache()
    model: dict[tuple[int, int], tuple[int, bytes]] = {}
    for (lid, eid), payload in puts:
        crc = record_crc(lid, eid, payload)
        cache.put(lid, eid, crc, payload)
        model[(lid, eid)] = (crc, payload)
    return cache, model


@given(puts=PUTS, skip=st.frozensets(st.integers(0, 6), max_size=4))
def test_write_cache_matches_model(
    puts: list[tuple[tuple[int, int], bytes]], skip: frozenset[int]
) -> None:
    cache, model = _fill(puts)
    # the last value of each key, in (ledger, entry) order, without skipped ledgers
    expected = [
        (lid, eid, crc, payload)
        for (lid, eid), (crc, payload) in sorted(model.items())
        if lid not in skip
    ]
    assert list(cache.sorted_entries(skip)) == expected
    assert list(cache.sorted_entries()) == [
        (lid, eid, crc, payload) for (lid, eid), (crc, payload) in sorted(model.items())
    ]
    assert cache.count == len(cache) == len(model)
    for lid in range(7):
        for eid in range(10):
            found = model.get((lid, eid))
            assert cache.get(lid, eid) == (None if found is None else found[1])
        assert cache.entry_ids(lid) == sorted(e for (k, e) in model if k == lid)


@given(puts=PUTS)
def test_write_cache_size_is_entry_log_bytes_of_what_it_holds(
    puts: list[tuple[tuple[int, int], bytes]],
) -> None:
    """size is what sorted_entries() will take in the entry log: a record header plus the
    payload of each distinct key, with the payload it holds now (the last one put)."""
    cache, model = _fill(puts)
    assert cache.size == sum(RECORD_OVERHEAD + len(payload) for _, payload in model.values())
    assert cache.size == sum(RECORD_OVERHEAD + len(p) for *_, p in cache.sorted_entries())


@given(puts=st.lists(st.tuples(KEYS, st.binary(max_size=64)), max_size=30), data=st.data())
def test_write_cache_idempotent_re_add_keeps_size(
    puts: list[tuple[tuple[int, int], bytes]], data: st.DataObject
) -> None:
    """Adding the same (ledger, entry) again with identical bytes (a retry, a replay) changes
    nothing."""
    unique = dict(puts)
    cache, _ = _fill(list(unique.items()))
    size, count = cache.size, cache.count
    again = data.draw(st.lists(st.sampled_from(sorted(unique)), max_size=20)) if unique else []
    for lid, eid in again:
        payload = unique[(lid, eid)]
        cache.put(lid, eid, record_crc(lid, eid, payload), payload)
    assert (cache.size, cache.count) == (size, count)
    assert cache.size == sum(RECORD_OVERHEAD + len(p) for p in unique.values())


# --- read cache -------------------------------------------------------------------------

SEGMENT = 256
SEGMENTS = 4
MAX_SIZE = SEGMENT * SEGMENTS


class ReadCacheMachine(RuleBasedStateMachine):
    """Puts of entries up to a segment's size (and some larger ones of new keys); after each
    step: no get() returns bytes other than the last ones put for its key, the cache holds
    at most max_size bytes, and the newest entries that fit in one segment are all found."""

    @initialize(segments=st.integers(2, 8), extra=st.integers(0, 7))
    def setup(self, segments: int, extra: int) -> None:
        # max_size need not divide evenly; a segment is SEGMENT bytes either way
        self.max_size = SEGMENT * segments + extra % segments
        self.cache = ReadCache(self.max_size, segments)
        self.last: dict[tuple[int, int], bytes] = {}  # key -> last bytes put and cached
        self.history: list[tuple[tuple[int, int], int]] = []  # (key, length) of cached puts
        self.oversize: set[tuple[int, int]] = set()
        self.next_fresh = 0

    @rule(key=KEYS, payload=st.binary(max_size=SEGMENT))
    def put(self, key: tuple[int, int], payload: bytes) -> None:
        self.cache.put(*key, payload)
        self.last[key] = payload
        self.history.append((key, len(payload)))

    @rule(data=st.data())
    @precondition(lambda self: bool(self.last))
    def put_again_same_bytes(self, data: st.DataObject) -> None:
        """A re-read of a cached entry (read-ahead over entries already cached)."""
        key = data.draw(st.sampled_from(sorted(self.last)))
        self.cache.put(*key, self.last[key])
        self.history.append((key, len(self.last[key])))

    @rule(size=st.integers(SEGMENT + 1, 3 * SEGMENT))
    def put_larger_than_a_segment(self, size: int) -> None:
        key = (1000, self.next_fresh)  # a key never put before
        self.next_fresh += 1
        self.cache.put(*key, bytes([7]) * size)
        self.oversize.add(key)

    @invariant()
    def gets_are_exact_or_none(self) -> None:
        for key, payload in self.last.items():
            found = self.cache.get(*key)
            assert found is None or found == payload, key

    @invariant()
    def larger_than_a_segment_not_cached(self) -> None:
        for key in self.oversize:
            assert self.cache.get(*key) is None

    @invariant()
    def bounded(self) -> None:
        assert 0 <= self.cache.size <= self.max_size
        held = sum(len(f) for k in self.last if (f := self.cache.get(*k)) is not None)
        assert held <= self.max_size

    @invariant()
    def newest_segment_worth_found(self) -> None:
        total = 0
        for key, length in reversed(self.history):
            total += length
            if total > SEGMENT:
                break
            assert self.cache.get(*key) == self.last[key], key


ReadCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None
)
test_read_cache_machine = ReadCacheMachine.TestCase


@given(
    puts=st.lists(
        st.tuples(
            KEYS,
            st.one_of(
                st.binary(max_size=SEGMENT),
                st.integers(SEGMENT + 1, 2 * SEGMENT).map(lambda n: b"L" * n),
            ),
        ),
        max_size=40,
    ),
)
def test_read_cache_never_returns_bytes_other_than_the_last_put(
    puts: list[tuple[tuple[int, int], bytes]],
) -> None:
    """With entries of any size: a put that is too large to cache must not leave an older
    value of the same key behind to be served instead."""
    cache = ReadCache(MAX_SIZE, SEGMENTS)
    last: dict[tuple[int, int], bytes] = {}
    for key, payload in puts:
        cache.put(*key, payload)
        last[key] = payload
        for k, p in last.items():
            found = cache.get(*k)
            assert found is None or found == p, (k, len(p))
        assert cache.size <= MAX_SIZE


@given(length=st.integers(SEGMENT + 1, 4 * MAX_SIZE), segments=st.integers(2, 8))
def test_read_cache_entry_larger_than_segment_not_cached(length: int, segments: int) -> None:
    cache = ReadCache(SEGMENT * segments, segments)
    cache.put(1, 1, b"x" * 10)
    cache.put(2, 2, bytes(length))
    assert cache.get(2, 2) is None
    assert cache.get(1, 1) == b"x" * 10  # and it evicted nothing
    assert cache.size == 10


@given(st.lists(st.lists(st.binary(max_size=64), min_size=1, max_size=20), max_size=8))
def test_a_batch_put_is_the_same_as_its_entries_put_one_by_one(batches: list[list[bytes]]) -> None:
    by_batch, one_by_one = WriteCache(), WriteCache()
    first = 0
    for payloads in batches:
        crcs = [record_crc(3, first + n, p) for n, p in enumerate(payloads)]
        by_batch.put_batch(3, first, crcs, payloads)
        for n, (crc, payload) in enumerate(zip(crcs, payloads, strict=True)):
            one_by_one.put(3, first + n, crc, payload)
        first += len(payloads)
    assert (by_batch.size, by_batch.count) == (one_by_one.size, one_by_one.count)
    assert list(by_batch.sorted_entries()) == list(one_by_one.sorted_entries())
