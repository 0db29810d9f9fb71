"""The entry log writer on real files: what a checkpoint appends (ledger by ledger, rolling
logs at their size limit) lands where the locations say, and each sealed log's ledgers map
counts exactly the bytes of each ledger it holds, no ledger it does not."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from node.settings import load
from node.storage import entrylog, logformat
from node.storage.entrylog import EntryLogWriter, LedgerEntries, LogIdAllocator
from node.storage.wal import record_crc

# Entries of a few ledgers; sizes around the small log limit so that rolls fall before a
# ledger's first entry, in the middle of a ledger, and right after its last one.
LEDGERS = st.dictionaries(
    st.integers(0, 20),
    st.lists(st.integers(0, 3000), min_size=1, max_size=12),
    min_size=1,
    max_size=5,
)
CHECKPOINTS = st.lists(LEDGERS, min_size=1, max_size=3)
LOG_SIZE_LIMIT = 8 * 1024


def _entries(ledgers: dict[int, list[int]], first: dict[int, int]) -> list[LedgerEntries]:
    found = []
    for ledger_id in sorted(ledgers):
        start = first.get(ledger_id, 0)
        ids = list(range(start, start + len(ledgers[ledger_id])))
        first[ledger_id] = start + len(ids)
        by_id = {}
        for entry_id, size in zip(ids, ledgers[ledger_id], strict=True):
            payload = bytes([entry_id % 251]) * size
            by_id[entry_id] = (record_crc(ledger_id, entry_id, payload), payload)
        found.append((ledger_id, ids, by_id))
    return found


@settings(max_examples=60, deadline=None)
@given(checkpoints=CHECKPOINTS)
def test_locations_and_ledgers_maps_match_what_was_written(
    checkpoints: list[dict[int, list[int]]],
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        s = load(data_dir=Path(tmp), log_size_limit=LOG_SIZE_LIMIT, max_entry_size=4096)
        writer = EntryLogWriter(s, LogIdAllocator(s.ledgers_dir))
        first: dict[int, int] = {}
        written: dict[int, tuple[int, int, bytes]] = {}  # location -> ledger, entry, payload
        for ledgers in checkpoints:
            entries = _entries(ledgers, first)
            locations = writer.append(entries)
            writer.flush()
            assert [len(ids) for _lid, ids, _by_id in entries] == list(map(len, locations))
            for (ledger_id, ids, by_id), found in zip(entries, locations, strict=True):
                for entry_id, location in zip(ids, found, strict=True):
                    written[location] = (ledger_id, entry_id, by_id[entry_id][1])
        writer.roll()
        writer.flush()

        scanned: dict[int, tuple[int, int, bytes]] = {}
        for log_id in entrylog.list_logs(s.ledgers_dir):
            path = logformat.log_path(s.ledgers_dir, log_id)
            sizes: dict[int, int] = {}
            for record in entrylog.scan(path):
                assert record.crc_ok
                if record.ledger_id < 0:
                    continue  # the ledgers map's own records
                location = logformat.location(log_id, record.offset)
                scanned[location] = (record.ledger_id, record.entry_id, record.payload)
                size = logformat.RECORD_OVERHEAD + len(record.payload)
                sizes[record.ledger_id] = sizes.get(record.ledger_id, 0) + size
            assert entrylog.read_ledgers_map(path) == sizes, f"log {log_id}"
        assert scanned == written
