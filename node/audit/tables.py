"""The Arrow schemas of an audit snapshot's tables (their names and file suffix are
node.audit.kept's). Apart from node.audit.snapshot, which writes them with the engine's index
at hand, so that the executors that read them (node.audit.source) import pyarrow alone, never
the engine (tests/audit/test_worker_imports.py)."""

from __future__ import annotations

import pyarrow as pa

SCHEMAS: dict[str, pa.Schema] = {
    "locations": pa.schema(
        [
            ("node", pa.string()),
            ("ledger_id", pa.int64()),
            ("entry_id", pa.int64()),
            ("log_id", pa.int64()),
            ("offset", pa.int64()),
        ]
    ),
    "ledgers": pa.schema(
        [
            ("node", pa.string()),
            ("ledger_id", pa.int64()),
            ("state", pa.string()),
            ("lac", pa.int64()),
            ("last_entry_id", pa.int64()),
            ("entries", pa.int64()),
            ("payload_bytes", pa.int64()),
            ("created_ms", pa.int64()),
            ("closed_ms", pa.int64()),
            ("stream", pa.string()),
            ("offload_state", pa.string()),
            ("offload_attempt", pa.string()),
            ("offload_data_bytes", pa.int64()),
            ("offload_local_deleted", pa.bool_()),
            ("writer_lac", pa.int64()),  # a replica: the highest LAC the writer sent it
        ]
    ),
    "logs": pa.schema(
        [
            ("node", pa.string()),
            ("log_id", pa.int64()),
            ("size_bytes", pa.int64()),
            ("mtime_ms", pa.int64()),
            ("error", pa.string()),
        ]
    ),
    "log_ledgers": pa.schema(
        [
            ("node", pa.string()),
            ("log_id", pa.int64()),
            ("ledger_id", pa.int64()),
            ("bytes", pa.int64()),
        ]
    ),
    "streams": pa.schema([("node", pa.string()), ("stream", pa.string()), ("record", pa.string())]),
    "cursors": pa.schema(
        [
            ("node", pa.string()),
            ("stream", pa.string()),
            ("cursor", pa.string()),
            ("mark_ledger", pa.int64()),
            ("mark_entry", pa.int64()),
        ]
    ),
    "doomed": pa.schema(
        [("node", pa.string()), ("ledger_id", pa.int64()), ("stream", pa.string())]
    ),
}
