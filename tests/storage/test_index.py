"""The locations index keeps runs of consecutive entries under one key: every lookup,
scan, relocation and expansion must answer exactly as one key per entry would, against a
plain dict of what was written (real RocksDB in a temporary directory)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.storage.index import (
    LOCATION_KEY,
    LOCATION_VALUE,
    MAX_ID,
    RUN_ENTRIES,
    Index,
    LedgerMeta,
    encode_run,
    run_length,
)

Model = dict[tuple[int, int], int]


def _write(index: Index, model: Model, ledger_id: int, entry_ids: list[int]) -> None:
    """One checkpoint's write of ``entry_ids`` (ascending, none indexed yet)."""
    locations = [random.getrandbits(63) for _ in entry_ids]
    index.write([(ledger_id, entry_ids, locations)], [LedgerMeta(ledger_id)])
    model.update(((ledger_id, e), loc) for e, loc in zip(entry_ids, locations, strict=True))


def _keys(index: Index) -> list[tuple[int, int]]:
    return [LOCATION_KEY.unpack(cast(bytes, key)) for key, _value in index._locations.items()]


def _check(index: Index, model: Model, ledgers: range) -> None:
    assert list(index.locations()) == sorted((lid, eid, loc) for (lid, eid), loc in model.items())
    ids = sorted(model)
    for lid in ledgers:
        mine = [e for ledger, e in ids if ledger == lid]
        assert list(index.entry_ids(lid)) == mine
        if mine:  # a scan from inside a run, and one that ends inside another
            low, high = mine[len(mine) // 3], mine[2 * len(mine) // 3]
            assert list(index.entry_ids(lid, low + 1, high)) == [e for e in mine if low < e <= high]
    asked = [*model, (ledgers.stop, 0), (ledgers.start, MAX_ID)]
    asked += [(lid, eid + 1) for lid, eid in model] + [(lid, eid - 1) for lid, eid in model if eid]
    random.shuffle(asked)
    expected = [model.get(key) for key in asked]
    assert index.get_locations(asked) == expected
    assert [index.get_location(lid, eid) for lid, eid in asked[:200]] == expected[:200]


@pytest.fixture
def index(tmp_path: Path):  # type: ignore[no-untyped-def]
    opened = Index(tmp_path / "index")
    yield opened
    opened.close()


def test_consecutive_entries_are_one_key_per_run_and_gaps_split_runs(index: Index) -> None:
    model: Model = {}
    entry_ids = [*range(0, 1200), 1500, *range(1502, 1511)]
    _write(index, model, 7, entry_ids)
    _write(index, model, 8, [5])
    firsts = [eid for lid, eid in _keys(index) if lid == 7]
    assert firsts == [0, RUN_ENTRIES, 2 * RUN_ENTRIES, 1500, 1502]
    assert _keys(index)[-1] == (8, 5)
    assert index.estimated_keys() >= 0
    _check(index, model, range(6, 10))


def test_entries_indexed_one_key_each_before_runs_read_as_they_are(index: Index) -> None:
    """An index from before runs holds an 8-byte location per entry; runs written later
    sit beside them."""
    model: Model = {}
    for eid in range(10, 20):
        key = LOCATION_KEY.pack(3, eid)
        index._locations[key] = LOCATION_VALUE.pack(1000 + eid)
        model[(3, eid)] = 1000 + eid
    _write(index, model, 3, list(range(20, 700)))
    _check(index, model, range(2, 5))
    moves = [(3, 15, 1015, 1), (3, 600, model[(3, 600)], 2)]
    assert index.relocate(moves) == 2
    model[(3, 15)], model[(3, 600)] = 1, 2
    _check(index, model, range(2, 5))


def test_relocate_moves_only_entries_that_still_point_at_the_old_place(
    index: Index, tmp_path: Path
) -> None:
    model: Model = {}
    _write(index, model, 1, list(range(0, 2000)))
    _write(index, model, 2, list(range(0, 50)))
    moves = [(1, eid, model[(1, eid)], 10_000 + eid) for eid in range(100, 1500, 3)]
    stale = [(1, 1501, model[(1, 1501)] ^ 1, 7), (2, 60, 0, 7), (9, 0, 0, 7)]
    random.shuffle(moves)  # compaction meets them in log order; any order must do
    assert index.relocate(moves + stale) == len(moves)
    for _lid, eid, _old, new in moves:
        model[(1, eid)] = new
    _check(index, model, range(0, 10))
    index.close()
    reopened = Index(tmp_path / "index")
    try:
        _check(reopened, model, range(0, 10))
    finally:
        reopened.close()


def test_an_entry_indexed_twice_hides_no_other_entry(index: Index) -> None:
    """Runs never overlap (an entry is indexed once). Should one entry ever be indexed
    again, as a run of its own, the entries after it in the first run stay found."""
    model: Model = {}
    _write(index, model, 4, list(range(0, RUN_ENTRIES)))
    index.write([(4, [5], [99])], [])
    copies = {model[(4, 5)], 99}  # either copy of entry 5 may be answered
    asked = [*sorted(model), (4, RUN_ENTRIES)]
    for found in (index.get_locations(asked), [index.get_location(*key) for key in asked]):
        for key, location in zip(asked, found, strict=True):
            assert location in copies if key == (4, 5) else location == model.get(key), key
    assert list(index.entry_ids(4)) == list(range(RUN_ENTRIES))
    assert list(index.entry_ids(4, 3, 8)) == [3, 4, 5, 6, 7, 8]


def test_a_damaged_run_is_an_error_not_a_wrong_location() -> None:
    assert run_length(encode_run([1, 2, 3])) == 3
    assert run_length(LOCATION_VALUE.pack(5)) == 1
    for bad in (b"", b"\x01", b"\x02" + b"\0" * 8, encode_run([1])[:-1] + b"\0\0"):
        with pytest.raises(ValueError, match="location run"):
            run_length(bad)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    checkpoints=st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3000), max_size=600)),
        min_size=1,
        max_size=6,
    ),
    moved=st.floats(0, 1),
    seed=st.integers(0, 2**32),
)
def test_runs_answer_as_one_key_per_entry_would(
    tmp_path_factory: pytest.TempPathFactory,
    checkpoints: list[tuple[int, list[int]]],
    moved: float,
    seed: int,
) -> None:
    """Checkpoints of random (disjoint) entry ids, then a compaction's moves of a random
    share of them: the index answers as the model does."""
    random.seed(seed)
    index = Index(tmp_path_factory.mktemp("index"))
    try:
        model: Model = {}
        for ledger_id, ids in checkpoints:
            fresh = sorted({e for e in ids if (ledger_id, e) not in model})
            if fresh:
                _write(index, model, ledger_id, fresh)
        moves = [(lid, eid, loc, loc + 1) for (lid, eid), loc in model.items()]
        moves = random.sample(moves, int(len(moves) * moved))
        assert index.relocate(moves) == len(moves)
        for lid, eid, _old, new in moves:
            model[(lid, eid)] = new
        _check(index, model, range(0, 4))
    finally:
        index.close()
