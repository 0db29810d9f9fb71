"""Corruption tests: flip bytes in the node's files and prove it notices (CRC32C), never
serves the bad bytes, and behaves as docs/internals.md's durability rules say: a torn
journal tail is cut, corruption before the tail stops the start naming file and offset,
unless the operator explicitly allows skipping it."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from node.storage import entrylog, journalformat, logformat
from node.wire import decode_range
from tests.harness.files import flip_byte
from tests.harness.node import NodeProcess

NO_CHECKPOINT = {"NODE_FLUSH_INTERVAL_MS": "3600000"}  # keep everything in the journal
ENTRIES = 40


def _put(node: NodeProcess, ledger: int, entry: int, payload: bytes) -> None:
    request = urllib.request.Request(
        f"{node.url}/api/v1/ledgers/{ledger}/entries/{entry}",
        data=payload,
        method="PUT",
        headers={"Content-Type": "application/octet-stream"},
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.status == 201


def _create(node: NodeProcess, ledger: int) -> None:
    request = urllib.request.Request(f"{node.url}/api/v1/ledgers/{ledger}", method="PUT")
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.status == 201


def _payload(entry: int) -> bytes:
    return bytes([entry % 251]) * (100 + entry)


def _status(node: NodeProcess, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"{node.url}{path}", timeout=10) as r:
            return r.status, bytes(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _journal_records(path: Path) -> list[tuple[int, int, int]]:
    """(offset, ledger id, entry id) of each record of a journal file."""
    data = path.read_bytes()
    records = []
    pos = journalformat.HEADER_SIZE
    while pos + journalformat.RECORD_HEADER.size <= len(data):
        mask, pad = journalformat.PADDING_HEADER.unpack_from(data, pos)
        if mask == journalformat.PADDING_MASK:
            pos += journalformat.PADDING_HEADER.size + pad
            continue
        length, ledger, entry, _crc = journalformat.RECORD_HEADER.unpack_from(data, pos)
        if length == 0 and ledger == 0:
            break
        records.append((pos, ledger, entry))
        pos += journalformat.RECORD_HEADER.size + length
    return records


def _crashed_node_with_journal(tmp_path: Path) -> tuple[Path, Path]:
    """A data dir whose entries are only in the journal (SIGKILL before any checkpoint),
    each entry in its own group write; returns (data dir, last journal file)."""
    data = tmp_path / "data"
    node = NodeProcess(data, env=NO_CHECKPOINT)
    node.start()
    _create(node, 5)
    for entry in range(ENTRIES):
        _put(node, 5, entry, _payload(entry))
    node.kill()
    newest = max(journalformat.list_journals(data / "journal"))
    return data, journalformat.journal_path(data / "journal", newest)


def test_flipped_journal_record_stops_the_start_naming_file_and_offset(tmp_path: Path) -> None:
    data, txn = _crashed_node_with_journal(tmp_path)
    offset, ledger, entry = next(r for r in _journal_records(txn) if r[2] == 3)
    flip_byte(txn, offset + journalformat.RECORD_HEADER.size + 10)  # inside the payload

    node = NodeProcess(data, env=NO_CHECKPOINT)
    with pytest.raises(AssertionError, match="node exited"):
        node.start()
    assert node.proc is not None and node.proc.returncode != 0
    log = node.log()
    assert str(txn) in log and f"offset {offset}" in log and "CRC32C mismatch" in log

    # The operator's explicit choice: skip it. The bad entry is gone, never served corrupt.
    node = NodeProcess(
        data, env={**NO_CHECKPOINT, "NODE_SKIP_REPLAY_JOURNAL_INVALID_RECORD": "true"}
    )
    node.start()
    try:
        status, _ = _status(node, f"/api/v1/ledgers/{ledger}/entries/{entry}")
        assert status == 404
        for other in (0, 1, 2, ENTRIES - 1):
            assert _status(node, f"/api/v1/ledgers/5/entries/{other}") == (200, _payload(other))
        assert node.get_json("/api/v1/ledgers/5")["lac"] == entry - 1  # a hole stops the LAC
    finally:
        assert node.terminate() == 0


def test_torn_journal_tail_is_cut_and_everything_before_it_survives(tmp_path: Path) -> None:
    data, txn = _crashed_node_with_journal(tmp_path)
    records = _journal_records(txn)
    last_offset, _ledger, last_entry = records[-1]
    assert last_entry == ENTRIES - 1
    with open(txn, "r+b") as f:  # a crash in the middle of the last group's write
        f.truncate(last_offset + journalformat.RECORD_HEADER.size + 7)

    node = NodeProcess(data)
    node.start()
    try:
        for entry in range(ENTRIES - 1):
            assert _status(node, f"/api/v1/ledgers/5/entries/{entry}") == (200, _payload(entry))
        assert _status(node, f"/api/v1/ledgers/5/entries/{last_entry}")[0] == 404
        assert node.get_json("/api/v1/ledgers/5")["lac"] == ENTRIES - 2
        assert "cutting torn journal tail" in node.log()
    finally:
        assert node.terminate() == 0


def test_garbage_after_the_journal_tail_is_cut(tmp_path: Path) -> None:
    data, txn = _crashed_node_with_journal(tmp_path)
    records = _journal_records(txn)
    end = records[-1][0] + journalformat.RECORD_HEADER.size + len(_payload(ENTRIES - 1))
    with open(txn, "r+b") as f:  # a torn sector write: random bytes where zeros were
        f.seek(end + 600)
        f.write(os.urandom(300))
    node = NodeProcess(data)
    node.start()
    try:
        for entry in range(ENTRIES):
            assert _status(node, f"/api/v1/ledgers/5/entries/{entry}") == (200, _payload(entry))
    finally:
        assert node.terminate() == 0


def test_flipped_entry_log_record_is_detected_and_never_served(tmp_path: Path) -> None:
    data = tmp_path / "data"
    node = NodeProcess(data)
    node.start()
    _create(node, 9)
    for entry in range(ENTRIES):
        _put(node, 9, entry, _payload(entry))
    assert node.terminate() == 0  # graceful: everything is in entry logs and indexed

    ledgers_dir = data / "ledgers"
    victim = None
    for log_id in entrylog.list_logs(ledgers_dir):
        for record in entrylog.scan(logformat.log_path(ledgers_dir, log_id)):
            if record.ledger_id == 9 and record.entry_id == 17:
                victim = (logformat.log_path(ledgers_dir, log_id), record.offset)
    assert victim is not None
    flip_byte(victim[0], victim[1] + logformat.RECORD_OVERHEAD + 50)

    node = NodeProcess(data)
    node.start()
    try:
        for _ in range(2):  # and again: nothing bad was cached by the first attempt
            status, body = _status(node, "/api/v1/ledgers/9/entries/17")
            assert status == 500
            error = json.loads(body)
            assert error["code"] == "corrupt_record"
            assert str(victim[0]) in error["message"] and str(victim[1]) in error["message"]
        # Neighbours read fine, including those read ahead around the bad record.
        for entry in (16, 18, 0, ENTRIES - 1):
            assert _status(node, f"/api/v1/ledgers/9/entries/{entry}") == (200, _payload(entry))
        # A range over the bad record stops before it, cut short (it never yields the bad
        # bytes); the read that starts there is refused as the single read is.
        url = f"{node.url}/api/v1/ledgers/9/entries?from=10&to=20"
        with urllib.request.urlopen(url, timeout=30) as reply:
            served = dict(decode_range(reply.read()))
            assert reply.headers["X-Truncated"] == "true"
            assert reply.headers["X-Next-Entry-Id"] == "17"
        assert served == {entry: _payload(entry) for entry in range(10, 17)}
        status, body = _status(node, "/api/v1/ledgers/9/entries?from=17&to=20")
        assert status == 500 and json.loads(body)["code"] == "corrupt_record"
        assert node.get_json("/api/v1/ledgers/9")["lac"] == ENTRIES - 1  # still serving
    finally:
        assert node.terminate() == 0
