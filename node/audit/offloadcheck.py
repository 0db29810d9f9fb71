"""Checking one offloaded ledger's objects against its metadata (a Spark task; no pyspark).

The index object must decode (its own CRC32C), name the ledger, and carry the metadata the
node has (LAC, last entry, entries, bytes); the data object must be as long as both the
index object and the ledger's offload record say; every block must pass its CRC32C and
header check; and the entries, walked block by block, must be ids 0..last with no gap,
as many and as many payload bytes as the metadata says.
"""

from __future__ import annotations

from typing import Any

from node.offload.format import (
    BLOCK_HEADER,
    ENTRY_HEADER,
    FormatError,
    LedgerIndex,
    check_block,
    data_key,
    index_key,
)

# (metadata key in the index object, column of the snapshot's ledgers table)
COMPARED = (
    ("lac", "lac"),
    ("lastEntryId", "last_entry_id"),
    ("entries", "entries"),
    ("bytes", "payload_bytes"),
)


def open_store(url: str) -> Any:
    from obstore.store import from_url

    return from_url(url)


def _get(store: Any, key: str) -> bytes:
    import obstore

    return bytes(obstore.get(store, key).bytes())


def check_ledger(store: Any, ledger: dict[str, Any]) -> list[str]:
    """What is wrong with one offloaded ledger's objects (empty: nothing)."""
    lid, attempt = int(ledger["ledger_id"]), str(ledger["offload_attempt"])
    try:
        index = LedgerIndex.decode(_get(store, index_key(lid, attempt)))
    except FormatError as e:
        return [f"index object {index_key(lid, attempt)}: {e}"]
    except Exception as e:  # obstore: a missing object, an unreachable store
        return [f"index object {index_key(lid, attempt)} unreadable: {e}"]
    problems = []
    if index.ledger_id != lid:
        problems.append(f"index object names ledger {index.ledger_id}")
    for key, column in COMPARED:
        if index.metadata.get(key) != ledger[column]:
            problems.append(
                f"index object says {key} {index.metadata.get(key)}, metadata {ledger[column]}"
            )
    if index.data_length != ledger["offload_data_bytes"]:
        problems.append(
            f"index object says {index.data_length} data bytes, "
            f"the offload record {ledger['offload_data_bytes']}"
        )
    try:
        data = _get(store, data_key(lid, attempt))
    except Exception as e:
        return [*problems, f"data object {data_key(lid, attempt)} unreadable: {e}"]
    if len(data) != index.data_length:
        problems.append(f"data object is {len(data)} bytes, index object says {index.data_length}")
        return problems
    expected, payload_bytes = 0, 0
    for block in index.blocks:
        chunk = data[block.offset : block.offset + block.length]
        try:
            check_block(chunk, block, data_key(lid, attempt))
        except FormatError as e:
            problems.append(str(e))
            return problems
        pos = BLOCK_HEADER.size
        while pos < len(chunk):
            size, entry_id = ENTRY_HEADER.unpack_from(chunk, pos)
            if entry_id != expected:
                problems.append(f"entry {entry_id} where entry {expected} was due")
                return problems
            pos += ENTRY_HEADER.size + size
            payload_bytes += size
            expected += 1
    if expected != ledger["entries"] or payload_bytes != ledger["payload_bytes"]:
        problems.append(
            f"data object holds {expected} entries of {payload_bytes} bytes, metadata "
            f"{ledger['entries']} of {ledger['payload_bytes']}"
        )
    return problems
