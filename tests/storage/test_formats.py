"""Property tests of the on-disk and on-wire formats (each documented atop the module
that encodes it).

Each encoder is checked against its decoder over the whole domain of its fields, and each
decoder against inputs it must refuse (wrong magic, wrong version, truncated frames).
"""

from __future__ import annotations

import asyncio
import random
import struct

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from node import wire as frames
from node.settings import SettingsError, load
from node.storage import journal, journalformat, logformat
from node.storage.index import LedgerMeta, LedgerState
from node.storage.wal import BatchRecord, record_crc

U32 = st.integers(0, (1 << 32) - 1)
U64 = st.integers(0, (1 << 64) - 1)
I64 = st.integers(-(1 << 63), (1 << 63) - 1)
LEDGER_IDS = st.integers(0, (1 << 63) - 1)
ENTRY_IDS = I64  # negative ids are the metadata records of wal.py
PAYLOADS = st.binary(max_size=600)
# The alignments for which a padding record (8 bytes at least) can always be built.
ALIGNMENTS = st.sampled_from([8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])


def bad_magic(magic: bytes) -> st.SearchStrategy[bytes]:
    return st.binary(min_size=4, max_size=4).filter(lambda m: m != magic)


# --- journal ----------------------------------------------------------------------------


def test_journal_header_round_trip() -> None:
    header = journalformat.encode_header()
    assert len(header) == journalformat.HEADER_SIZE == 512
    assert header[:4] == b"BKLG"
    assert struct.unpack(">I", header[4:8]) == (journalformat.VERSION,)
    assert not any(header[8:])
    assert journalformat.decode_header(header) == journalformat.VERSION


@given(magic=bad_magic(b"BKLG"))
def test_journal_header_wrong_magic_rejected(magic: bytes) -> None:
    header = magic + journalformat.encode_header()[4:]
    with pytest.raises(ValueError, match="magic"):
        journalformat.decode_header(header)


@given(version=U32.filter(lambda v: v not in journalformat.READABLE_VERSIONS))
def test_journal_header_wrong_version_rejected(version: int) -> None:
    header = b"BKLG" + struct.pack(">I", version) + bytes(504)
    with pytest.raises(ValueError, match="version"):
        journalformat.decode_header(header)


def test_journal_version_1_is_still_read() -> None:
    """Version 2 only added the batch record: a version 1 journal replays as it is."""
    header = b"BKLG" + struct.pack(">I", 1) + bytes(504)
    assert journalformat.decode_header(header) == 1


@given(
    ledger_id=LEDGER_IDS,
    first=st.integers(0, 1 << 62),
    payloads=st.lists(PAYLOADS, min_size=1, max_size=12),
    limit=st.sampled_from([16, 100, 700, 4096, 1 << 20]),
)
def test_journal_batch_records_round_trip(
    ledger_id: int, first: int, payloads: list[bytes], limit: int
) -> None:
    """A batch is encoded as batch records of at most ``limit`` payload bytes (an entry
    sharing none as a plain record); decoded, they give back every entry and its CRC."""
    crcs = [record_crc(ledger_id, first + n, p) for n, p in enumerate(payloads)]
    parts, size = journalformat.encode_batch(ledger_id, first, crcs, payloads, limit)
    data = b"".join(parts)
    assert len(data) == size
    got: list[tuple[int, int, int, bytes]] = []
    scan = journalformat.RecordScan(data, 0, len(data), len(data))
    for pos, end, lid, eid, crc, payload in scan:
        assert lid == ledger_id
        if eid == journal.BATCH:
            assert end - pos - 24 <= limit
            batch = journalformat.decode_batch(data, pos + 24, end, ledger_id)
            assert isinstance(batch, BatchRecord) and len(batch.payloads) > 1
            got += [
                (r.ledger_id, r.entry_id, c, r.payload)
                for r, c in zip(batch.records(), batch.crcs, strict=True)
            ]
        else:
            got.append((lid, eid, crc, payload))
    assert (scan.end, scan.invalid) == (len(data), None)
    expected = [
        (ledger_id, first + n, c, p) for n, (c, p) in enumerate(zip(crcs, payloads, strict=True))
    ]
    assert got == expected
    whole = 12 + sum(8 + len(p) for p in payloads)
    if len(payloads) > 1 and whole <= limit:
        assert struct.unpack_from(">q", data, 12) == (journal.BATCH,)  # one record for all
        assert len(data) == 24 + whole


@given(cut=st.integers(0, 40), count=st.integers(0, 3))
def test_journal_batch_record_with_a_wrong_table_is_refused(cut: int, count: int) -> None:
    """A batch record whose table does not add up to its length was written so (its CRC
    passed): the decoder names the fault instead of returning entries."""
    payloads = [b"a" * 10, b"b" * 20]
    parts, _size = journalformat.encode_batch(1, 0, [0, 0], payloads, 1 << 20)
    body = b"".join(parts)[24:]
    bad = (
        body[: len(body) - 1 - cut] if count == 0 else struct.pack(">qI", 0, 2 + count) + body[12:]
    )
    assert isinstance(journalformat.decode_batch(bad, 0, len(bad), 1), str)


@given(ledger_id=LEDGER_IDS, entry_id=ENTRY_IDS, payload=PAYLOADS, prefix=st.binary(max_size=40))
def test_journal_record_round_trip(
    ledger_id: int, entry_id: int, payload: bytes, prefix: bytes
) -> None:
    crc = record_crc(ledger_id, entry_id, payload)
    record = journalformat.encode_record(ledger_id, entry_id, crc, payload)
    assert len(record) == 24 + len(payload)
    buf = prefix + record + b"\xee" * 7  # decoding at an offset, with bytes after it
    assert journalformat.decode_record(buf, len(prefix)) == (len(payload), ledger_id, entry_id, crc)
    start = len(prefix) + 24
    assert buf[start : start + len(payload)] == payload


@given(ledger_id=LEDGER_IDS, entry_id=st.integers(-(1 << 63), -1), payload=PAYLOADS)
def test_journal_metadata_record_keeps_negative_entry_id(
    ledger_id: int, entry_id: int, payload: bytes
) -> None:
    crc = record_crc(ledger_id, entry_id, payload)
    record = journalformat.encode_record(ledger_id, entry_id, crc, payload)
    length, lid, eid, got_crc = journalformat.decode_record(record, 0)
    assert (length, lid, eid, got_crc) == (len(payload), ledger_id, entry_id, crc)
    assert eid < 0


def _check_padding(length: int, alignment: int) -> None:
    pad = journalformat.padding(length, alignment)
    assert (length + len(pad)) % alignment == 0
    if length % alignment == 0:
        assert pad == b""
        return
    assert len(pad) >= journalformat.PADDING_HEADER.size
    assert len(pad) < alignment + journalformat.PADDING_HEADER.size  # never a whole extra sector
    mask, pad_len = journalformat.PADDING_HEADER.unpack_from(pad)
    assert mask == journalformat.PADDING_MASK
    assert pad_len == len(pad) - journalformat.PADDING_HEADER.size
    assert not any(pad[journalformat.PADDING_HEADER.size :])


@given(length=st.integers(0, 1 << 22), alignment=ALIGNMENTS)
def test_journal_padding_aligns_and_parses(length: int, alignment: int) -> None:
    _check_padding(length, alignment)


@pytest.mark.parametrize("alignment", [8, 512])
def test_journal_padding_every_remainder(alignment: int) -> None:
    for length in range(3 * alignment):
        _check_padding(length, alignment)


@given(length=st.integers(0, 1 << 16), alignment=st.sampled_from([1, 2, 4]))
def test_journal_padding_small_alignments_accepted_by_settings(length: int, alignment: int) -> None:
    """Every alignment the settings accept must work: a power of two below 8 leaves gaps
    that an 8-byte padding record cannot fill (or the settings must refuse it)."""
    try:
        load(journal_alignment_size=alignment, journal_pre_alloc_size=1 << 20)
    except SettingsError:
        return  # refused at start: fine
    _check_padding(length, alignment)


# --- entry log --------------------------------------------------------------------------


@given(map_offset=U64, map_count=U32)
def test_entrylog_header_round_trip(map_offset: int, map_count: int) -> None:
    header = logformat.encode_header(map_offset, map_count)
    assert len(header) == logformat.HEADER_SIZE == 1024
    assert header[:4] == b"BKLO"
    assert not any(header[20:])
    assert logformat.decode_header(header) == (logformat.VERSION, map_offset, map_count)


def test_entrylog_header_defaults_to_no_map() -> None:
    assert logformat.decode_header(logformat.encode_header()) == (logformat.VERSION, 0, 0)


@given(map_offset=U64, map_count=U32, first=st.tuples(U64, U32))
def test_entrylog_header_patched_map_fields(
    map_offset: int, map_count: int, first: tuple[int, int]
) -> None:
    """The roll patches offset and count in place; the header then decodes to them and
    nothing else in it changes."""
    header = bytearray(logformat.encode_header(*first))
    start = logformat.MAP_FIELDS_OFFSET
    header[start : start + logformat.MAP_FIELDS.size] = logformat.MAP_FIELDS.pack(
        map_offset, map_count
    )
    assert bytes(header) == logformat.encode_header(map_offset, map_count)
    assert logformat.decode_header(bytes(header)) == (logformat.VERSION, map_offset, map_count)


@given(magic=bad_magic(b"BKLO"))
def test_entrylog_header_wrong_magic_rejected(magic: bytes) -> None:
    with pytest.raises(ValueError, match="magic"):
        logformat.decode_header(magic + logformat.encode_header()[4:])


@given(version=U32.filter(lambda v: v != logformat.VERSION))
def test_entrylog_header_wrong_version_rejected(version: int) -> None:
    header = bytearray(logformat.encode_header())
    header[4:8] = struct.pack(">I", version)
    with pytest.raises(ValueError, match="version"):
        logformat.decode_header(bytes(header))


@given(ledger_id=I64, entry_id=I64, payload=PAYLOADS, prefix=st.binary(max_size=40))
def test_entrylog_record_round_trip(
    ledger_id: int, entry_id: int, payload: bytes, prefix: bytes
) -> None:
    crc = record_crc(ledger_id, entry_id, payload)
    record = logformat.encode_record(ledger_id, entry_id, crc, payload)
    assert len(record) == logformat.RECORD_OVERHEAD + len(payload)
    # the size field counts the bytes after itself
    assert struct.unpack_from(">I", record) == (len(record) - logformat.SIZE_FIELD,)
    buf = prefix + record + b"\x01" * 5
    header = logformat.decode_record_header(buf, len(prefix))
    assert header == (len(payload), ledger_id, entry_id, crc)
    assert logformat.decode_record_header(memoryview(buf), len(prefix)) == header
    assert record[logformat.RECORD_OVERHEAD :] == payload


def _parse_map_records(data: bytes) -> list[dict[int, int]]:
    parts = []
    pos = 0
    while pos < len(data):
        length, lid, eid, crc = logformat.decode_record_header(data, pos)
        assert (lid, eid) == (logformat.LEDGERS_MAP_LEDGER_ID, logformat.LEDGERS_MAP_ENTRY_ID)
        payload = data[pos + logformat.RECORD_OVERHEAD : pos + logformat.RECORD_OVERHEAD + length]
        assert len(payload) == length
        assert record_crc(lid, eid, payload) == crc
        parts.append(logformat.decode_ledgers_map(payload))
        pos += logformat.RECORD_OVERHEAD + length
    assert pos == len(data)
    return parts


@given(sizes=st.dictionaries(LEDGER_IDS, U64, max_size=50))
def test_ledgers_map_round_trip(sizes: dict[int, int]) -> None:
    parts = _parse_map_records(logformat.encode_ledgers_map(sizes))
    merged = {k: v for part in parts for k, v in part.items()}
    assert merged == sizes
    assert len(parts) == (len(sizes) + logformat.LEDGERS_MAP_MAX_BATCH - 1) // 10_000


@settings(max_examples=8, deadline=None)
@given(
    count=st.one_of(st.integers(9_990, 10_010), st.integers(10_001, 35_000)),
    seed=st.integers(0, 1 << 32),
)
def test_ledgers_map_many_ledgers_split_in_records(count: int, seed: int) -> None:
    rnd = random.Random(seed)
    sizes: dict[int, int] = {}
    while len(sizes) < count:
        sizes[rnd.getrandbits(63)] = rnd.getrandbits(64)
    parts = _parse_map_records(logformat.encode_ledgers_map(sizes))
    assert len(parts) == -(-count // 10_000)
    assert all(1 <= len(part) <= logformat.LEDGERS_MAP_MAX_BATCH for part in parts)
    merged: dict[int, int] = {}
    for part in parts:
        assert not merged.keys() & part.keys()  # each ledger in exactly one record
        merged.update(part)
    assert merged == sizes


@given(sizes=st.dictionaries(LEDGER_IDS, U64, min_size=1, max_size=20), cut=st.integers(1, 15))
def test_ledgers_map_wrong_length_rejected(sizes: dict[int, int], cut: int) -> None:
    payload = logformat.encode_ledgers_map(sizes)[logformat.RECORD_OVERHEAD :]
    with pytest.raises(ValueError, match="count"):
        logformat.decode_ledgers_map(payload[:-cut])
    with pytest.raises(ValueError, match="count"):
        logformat.decode_ledgers_map(payload + bytes(cut))


@given(sizes=st.dictionaries(LEDGER_IDS, U64, max_size=30), log_size=U64)
def test_map_file_round_trip(sizes: dict[int, int], log_size: int) -> None:
    data = logformat.encode_map_file(log_size, sizes)
    assert data[:4] == logformat.MAP_FILE_MAGIC
    assert logformat.decode_map_file(data, log_size) == sizes
    assert logformat.decode_map_file(data, log_size ^ 1) is None  # the log is not the one scanned


@settings(max_examples=30)
@given(
    sizes=st.dictionaries(LEDGER_IDS, U64, max_size=4),
    log_size=U64,
    mask=st.integers(1, 255),
)
def test_map_file_flipped_or_cut_is_never_trusted(
    sizes: dict[int, int], log_size: int, mask: int
) -> None:
    """Every byte flipped and every cut: the map file is refused, GC scans the log again."""
    data = logformat.encode_map_file(log_size, sizes)
    for pos in range(len(data)):
        flipped = bytearray(data)
        flipped[pos] ^= mask
        assert logformat.decode_map_file(bytes(flipped), log_size) is None, f"byte {pos}"
    for cut in range(len(data)):
        if sizes or cut < logformat.MAP_FILE_HEADER.size:
            assert logformat.decode_map_file(data[:cut], log_size) is None, f"cut at {cut}"


def test_map_file_of_another_version_is_not_read() -> None:
    data = bytearray(logformat.encode_map_file(1024, {1: 100}))
    struct.pack_into(">I", data, 4, logformat.MAP_FILE_VERSION + 1)
    assert logformat.decode_map_file(bytes(data), 1024) is None


@given(log_id=st.integers(0, (1 << 31) - 1), offset=st.integers(0, (1 << 32) - 1))
def test_location_round_trip(log_id: int, offset: int) -> None:
    loc = logformat.location(log_id, offset)
    assert 0 <= loc < 1 << 63  # fits the index value and a signed 64-bit integer
    assert logformat.split_location(loc) == (log_id, offset)


@given(
    a=st.tuples(st.integers(0, (1 << 31) - 1), st.integers(0, (1 << 32) - 1)),
    b=st.tuples(st.integers(0, (1 << 31) - 1), st.integers(0, (1 << 32) - 1)),
)
def test_location_order_follows_log_then_offset(a: tuple[int, int], b: tuple[int, int]) -> None:
    loc_a, loc_b = logformat.location(*a), logformat.location(*b)
    assert (loc_a < loc_b) == (a < b)
    assert (loc_a == loc_b) == (a == b)


# --- ledger metadata --------------------------------------------------------------------

LEDGER_METAS = st.builds(
    LedgerMeta,
    ledger_id=LEDGER_IDS,
    state=st.sampled_from(list(LedgerState)),
    lac=st.one_of(st.just(-1), st.integers(0, (1 << 63) - 1)),
    last_entry_id=st.one_of(st.just(-1), st.integers(0, (1 << 63) - 1)),
    entries=U64,
    payload_bytes=U64,
    created_ms=U64,
    closed_ms=st.one_of(st.just(0), U64),
    token_digest=st.one_of(st.just(b""), st.binary(min_size=32, max_size=32)),
    properties=st.dictionaries(st.text(), st.text(), max_size=8),
)


@given(meta=LEDGER_METAS)
def test_ledger_meta_round_trip(meta: LedgerMeta) -> None:
    data = meta.encode()
    decoded = LedgerMeta.decode(meta.ledger_id, data)
    assert decoded == meta
    assert isinstance(decoded.state, LedgerState)
    assert decoded.encode() == data  # canonical: the same bytes again


@given(meta=LEDGER_METAS, extra=st.binary(min_size=1, max_size=8))
def test_ledger_meta_trailing_bytes_rejected(meta: LedgerMeta, extra: bytes) -> None:
    with pytest.raises(ValueError, match="length"):
        LedgerMeta.decode(meta.ledger_id, meta.encode() + extra)


@given(meta=LEDGER_METAS, version=st.integers(0, 255).filter(lambda v: v != 1))
def test_ledger_meta_wrong_version_rejected(meta: LedgerMeta, version: int) -> None:
    data = bytes([version]) + meta.encode()[1:]
    with pytest.raises(ValueError, match="version"):
        LedgerMeta.decode(meta.ledger_id, data)


# --- HTTP frames ------------------------------------------------------------------------

BATCHES = st.lists(st.binary(max_size=300), max_size=20)
NO_LIMIT = 1 << 30  # more entries than any drawn batch holds


def decode(body: bytes, max_entries: int = NO_LIMIT) -> list[bytes]:
    """The batch decoder hands the loop over as it goes: run it on a loop of its own."""
    return asyncio.run(frames.decode_batch(body, max_entries))


RANGES = st.lists(st.tuples(st.integers(0, (1 << 64) - 1), st.binary(max_size=300)), max_size=20)


@given(payloads=BATCHES)
def test_batch_round_trip(payloads: list[bytes]) -> None:
    body = frames.encode_batch(payloads)
    assert len(body) == sum(4 + len(p) for p in payloads)
    assert decode(body) == payloads


@given(payloads=BATCHES, limit=st.integers(0, 25))
def test_batch_max_entries(payloads: list[bytes], limit: int) -> None:
    body = frames.encode_batch(payloads)
    if len(payloads) > limit:
        with pytest.raises(frames.TooManyEntries):
            decode(body, limit)
    else:
        assert decode(body, limit) == payloads


def _frame_boundaries(sizes: list[int]) -> set[int]:
    bounds = {0}
    pos = 0
    for size in sizes:
        pos += size
        bounds.add(pos)
    return bounds


@given(payloads=BATCHES.filter(bool), data=st.data())
def test_batch_truncated_inside_a_frame_raises_frame_error(
    payloads: list[bytes], data: st.DataObject
) -> None:
    body = frames.encode_batch(payloads)
    bounds = _frame_boundaries([4 + len(p) for p in payloads])
    cut = data.draw(st.integers(1, len(body) - 1).filter(lambda c: c not in bounds))
    with pytest.raises(frames.FrameError):
        decode(body[:cut])


@given(payloads=BATCHES, data=st.data())
def test_batch_truncated_at_a_frame_boundary_is_a_prefix(
    payloads: list[bytes], data: st.DataObject
) -> None:
    body = frames.encode_batch(payloads)
    n = data.draw(st.integers(0, len(payloads)))
    cut = sum(4 + len(p) for p in payloads[:n])
    assert decode(body[:cut]) == payloads[:n]


@given(frames_=RANGES)
def test_range_round_trip(frames_: list[tuple[int, bytes]]) -> None:
    body = b"".join(frames.encode_range_frame(eid, p) for eid, p in frames_)
    assert len(body) == sum(12 + len(p) for _, p in frames_)
    assert list(frames.decode_range(body)) == frames_


@given(frames_=RANGES.filter(bool), data=st.data())
def test_range_truncated_inside_a_frame_raises_frame_error(
    frames_: list[tuple[int, bytes]], data: st.DataObject
) -> None:
    body = b"".join(frames.encode_range_frame(eid, p) for eid, p in frames_)
    bounds = _frame_boundaries([12 + len(p) for _, p in frames_])
    cut = data.draw(st.integers(1, len(body) - 1).filter(lambda c: c not in bounds))
    complete = sum(1 for b in bounds if 0 < b <= cut)
    got = []
    with pytest.raises(frames.FrameError):
        for item in frames.decode_range(body[:cut]):
            got.append(item)
    assert got == frames_[:complete]  # the whole frames before the cut came out first


# --- record CRC -------------------------------------------------------------------------


@given(ledger_id=LEDGER_IDS, other=LEDGER_IDS, entry_id=ENTRY_IDS, payload=PAYLOADS)
def test_record_crc_catches_other_ledger(
    ledger_id: int, other: int, entry_id: int, payload: bytes
) -> None:
    """Random other ids: caught with probability 1 - 2^-32 (a 32-bit CRC over 128 bits of
    ids has collisions, e.g. ledgers 7 and 4353911797 for entry 3 and b"payload"; the
    entry log reader compares the ids in the header as well)."""
    assume(other != ledger_id)
    assert record_crc(ledger_id, entry_id, payload) != record_crc(other, entry_id, payload)


@given(ledger_id=LEDGER_IDS, entry_id=ENTRY_IDS, other=ENTRY_IDS, payload=PAYLOADS)
def test_record_crc_catches_other_entry(
    ledger_id: int, entry_id: int, other: int, payload: bytes
) -> None:
    assume(other != entry_id)
    assert record_crc(ledger_id, entry_id, payload) != record_crc(ledger_id, other, payload)


@given(
    ledger_id=LEDGER_IDS,
    entry_id=st.integers(0, (1 << 63) - 2),
    payload=PAYLOADS,
    bit=st.integers(0, 62),
)
def test_record_crc_catches_neighbours_and_bit_flips_of_ids(
    ledger_id: int, entry_id: int, payload: bytes, bit: int
) -> None:
    """Deterministic cases (not just unlikely collisions): the next entry of the same
    ledger, and any single bit flipped in either id."""
    crc = record_crc(ledger_id, entry_id, payload)
    assert crc != record_crc(ledger_id, entry_id + 1, payload)
    assert crc != record_crc(ledger_id ^ (1 << bit), entry_id, payload)
    assert crc != record_crc(ledger_id, entry_id ^ (1 << bit), payload)


@given(
    ledger_id=LEDGER_IDS,
    entry_id=ENTRY_IDS,
    payload=st.binary(min_size=1, max_size=600),
    data=st.data(),
)
def test_record_crc_catches_any_single_bit_flip_of_payload(
    ledger_id: int, entry_id: int, payload: bytes, data: st.DataObject
) -> None:
    bit = data.draw(st.integers(0, 8 * len(payload) - 1))
    flipped = bytearray(payload)
    flipped[bit // 8] ^= 1 << (bit % 8)
    crc = record_crc(ledger_id, entry_id, payload)
    assert record_crc(ledger_id, entry_id, bytes(flipped)) != crc
    assert record_crc(ledger_id, entry_id, memoryview(payload)) == crc  # views hash alike


def test_record_crc_every_bit_of_a_small_payload() -> None:
    payload = bytes(range(64))
    crc = record_crc(7, 3, payload)
    for bit in range(8 * len(payload)):
        flipped = bytearray(payload)
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert record_crc(7, 3, bytes(flipped)) != crc
