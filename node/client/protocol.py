"""What a replicated ledger's client and a node say to each other over HTTP: the headers of
the bookie protocol, the error codes the client acts on, and the two frames it sends and
reads. The node's routes import these names (``node/wire.py`` keeps the same layouts
for its own frames); this module imports nothing of the node, so scripts and the Airflow venv
can use the client alone.

================  ==================  =====================================================
header            on                  meaning
================  ==================  =====================================================
X-Entry-Id        replica add         id of the first entry of the body (the writer chooses)
X-Lac             replica add, reply  the writer's last add confirmed when it sent the add
X-Lac-Length      replica add         bytes of the ledger up to and including X-Lac
X-Replicated      replica add         ``E/Qw/Qa``: marks the ledger replicated on this node
X-Recovery-Add    replica add         ``1``: a recovery's re-add, accepted on a fenced ledger
X-Expect-Node     any request         the node id the caller means; another node answers 421
X-Node-Id         every reply         the id of the node that answered
X-Next-Entry-Id   range read reply    the reply was cut (its byte budget): read on from here
================  ==================  =====================================================

Query flags: ``?fence=1`` on a LAC read or an entry read fences the ledger (journaled) before
the answer; ``?replicated=1`` on a LAC read answers the replica's view (writer LAC, highest
stored id, fenced) and, with ``fence=1``, creates an unknown ledger fenced.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator

ENTRY_ID_HEADER = "X-Entry-Id"
LAC_HEADER = "X-Lac"
LAC_LENGTH_HEADER = "X-Lac-Length"
REPLICATED_HEADER = "X-Replicated"
RECOVERY_ADD_HEADER = "X-Recovery-Add"
EXPECT_NODE_HEADER = "X-Expect-Node"
NODE_ID_HEADER = "X-Node-Id"
NEXT_ENTRY_HEADER = "X-Next-Entry-Id"

BATCH_CONTENT_TYPE = "application/x-entry-batch"  # len u32 | payload, consecutive ids
RANGE_CONTENT_TYPE = "application/x-entry-range"  # entry id u64 | len u32 | payload
OCTET_CONTENT_TYPE = "application/octet-stream"  # one entry

# Error codes (the JSON body's "code") the client decides on. Only the two "not found" codes
# mean "this replica does not hold it"; every other answer is "unknown" (BookKeeper #2908).
ENTRY_NOT_FOUND = "entry_not_found"
LEDGER_NOT_FOUND = "ledger_not_found"
NOT_FOUND_CODES = frozenset({ENTRY_NOT_FOUND, LEDGER_NOT_FOUND})
LEDGER_FENCED = "ledger_fenced"  # 409: the writer lost the ledger to a recovery
ENTRY_CONFLICT = "entry_conflict"  # 409: other bytes at this id (never in a correct run)
REPLICATED_LEDGER = "replicated_ledger"  # 409: a plain add/close on a replicated ledger
NOT_REPLICATED = "not_replicated"  # 409: a replica add to a node-local ledger
WRONG_NODE = "wrong_node"  # 421: X-Expect-Node names another node
RESERVED_LEDGER_ID = "reserved_ledger_id"  # 400: a local create in the fleet-wide id range
INVALID_LAC = "invalid_lac"  # 422: a replica add whose X-Lac is past the entries it carries

# The largest E, Qw or Qa: a replica's index keeps each in 16 bits (node/storage/index.py,
# REPLICATION_FIXED); an X-Replicated past it is refused, never stored cut.
MAX_QUORUM = 0xFFFF


def replication_header(ensemble: int, write_quorum: int, ack_quorum: int) -> str:
    return f"{ensemble}/{write_quorum}/{ack_quorum}"


def parse_replication_header(value: str) -> tuple[int, int, int]:
    """``E/Qw/Qa`` -> (E, Qw, Qa); ValueError unless MAX_QUORUM >= E >= Qw >= Qa >= 1."""
    parts = value.split("/")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{REPLICATED_HEADER} must be E/Qw/Qa, not {value[:40]!r}")
    e, qw, qa = (int(p) for p in parts)
    if not MAX_QUORUM >= e >= qw >= qa >= 1:
        raise ValueError(
            f"{REPLICATED_HEADER} needs {MAX_QUORUM} >= E >= Qw >= Qa >= 1, not {value!r}"
        )
    return e, qw, qa


_BATCH = struct.Struct(">I")
_RANGE = struct.Struct(">QI")


def encode_batch(payloads: Iterable[bytes]) -> bytes:
    """A body of consecutive entries: len u32 | payload, repeated."""
    return b"".join(_BATCH.pack(len(p)) + p for p in payloads)


def encode_range(entries: Iterable[tuple[int, bytes]]) -> bytes:
    """A body of entries at chosen ids: entry id u64 | len u32 | payload, repeated."""
    return b"".join(_RANGE.pack(eid, len(p)) + p for eid, p in entries)


def decode_range(body: bytes) -> Iterator[tuple[int, bytes]]:
    """The entries of a range body; ValueError on a cut or oversized frame."""
    view = memoryview(body)
    pos = 0
    while pos < len(view):
        if pos + _RANGE.size > len(view):
            raise ValueError(f"truncated range frame header at byte {pos}")
        eid, length = _RANGE.unpack_from(view, pos)
        start = pos + _RANGE.size
        if start + length > len(view):
            raise ValueError(f"range frame at byte {pos} runs past the body")
        yield eid, bytes(view[start : start + length])
        pos = start + length
