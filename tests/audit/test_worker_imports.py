"""What a Spark worker imports: the modules whose code the audit job ships to its executors
(the checks' closures, the entry log data source and its record reader) must not pull in the
node's engine (the index on RocksDB, the ledger storage, lifecycle, streams' manager, HTTP).
An executor then needs the log format and the stream rules only, and an engine change cannot
break, or slow down, every task of an audit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What the job ships: node.audit.checks (the offload check's task, the retention rule) and
# node.audit.source (the data source's reader, with node.audit.ranges).
SHIPPED = ("node.audit.checks", "node.audit.source", "node.audit.ranges", "node.audit.offloadcheck")
ENGINE = ("node.lifecycle", "node.http", "node.streams.manager", "rocksdict", "aiohttp")
# Of node.storage, the entry log's bytes (logformat) and the record CRC (wal): the worker
# reads the logs, never through the engine's writers and readers (entrylog). The namespace
# package itself comes with them.
LOG_FORMAT = {"node.storage", "node.storage.logformat", "node.storage.wal"}


# What a node's server leaves for the request that needs it: Arrow (audit snapshots) and
# botocore (S3 multipart uploads), a fifth of its imports, paid by every node start.
LATE = ("pyarrow", "numpy", "botocore")


def loaded_after(modules: tuple[str, ...]) -> list[str]:
    """sys.modules of a fresh interpreter that imported ``modules``."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return list(json.loads(done.stdout))


def test_the_modules_shipped_to_spark_workers_import_no_engine_module() -> None:
    loaded = loaded_after(SHIPPED)
    assert set(SHIPPED) <= set(loaded)
    engine = [m for m in loaded if any(m == e or m.startswith(e + ".") for e in ENGINE)]
    assert engine == []
    storage = {m for m in loaded if m == "node.storage" or m.startswith("node.storage.")}
    assert storage <= LOG_FORMAT, sorted(storage - LOG_FORMAT)


def test_the_node_server_starts_without_arrow_or_botocore() -> None:
    loaded = loaded_after(("node.cli", "node.http.app"))
    assert [m for m in loaded if m.split(".")[0] in LATE] == []


def test_the_table_names_are_those_of_the_schemas() -> None:
    from node.audit import kept, tables

    assert tuple(tables.SCHEMAS) == kept.TABLES
