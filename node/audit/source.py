"""A Spark 4 Python Data Source of entry log records (format name ``entrylog``).

    spark.dataSource.register(EntryLogDataSource)
    spark.read.format("entrylog")
        .option("logs", json.dumps([[node, ledgers_dir, log_id, size], ...]))
        .option("splitBytes", str(64 << 20)).load()

The logs are those of the snapshot, each read up to the size it had when the snapshot was
taken: a live node goes on appending after it, and records the snapshot's index cannot know
of would be reported as garbage. A size below 0 means the file's size at planning time (a
log the snapshot could not read: the scan says what is wrong with it).

Partitions are byte ranges of log files (``splitBytes`` each, so a 1 GiB log is many
tasks), planned from the snapshot's sizes alone; each task reads its range on the executor
and returns one row per record (see ``node.audit.ranges``), never a payload. A log's
directory is a local one (readable where the executors run: local mode) or the URL of a
snapshot's ``logs/`` that its node serves (``node.audit.remote``: executors anywhere).

The snapshot's tables come the same way (format ``snapshottable``): one task per node's
table, read where the executor runs, from the snapshot's directory or its URL; a column
the snapshot predates reads as null.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from node.audit import ranges, remote
from node.audit.kept import PARQUET_SUFFIX
from node.audit.tables import SCHEMAS
from node.storage import logformat

FORMAT = "entrylog"
TABLE_FORMAT = "snapshottable"
UNKNOWN_SIZE_END = 1 << 62  # a log whose size the snapshot lacks: read to its end
DEFAULT_SPLIT_BYTES = 64 * 1024 * 1024  # one task per 64 MiB of log (Spark's own default)


class LogRange(InputPartition):
    """One task: [start, end) of one log file."""

    def __init__(self, node: str, log_id: int, path: str, start: int, end: int) -> None:
        super().__init__((node, log_id, start))
        self.node = node
        self.log_id = log_id
        self.path = path
        self.start = start
        self.end = end


class EntryLogReader(DataSourceReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        # ``options`` is Spark's case-insensitive map, whose keys are stored lower case: a
        # plain dict made of it would lose "splitBytes" (every log one task, whatever the
        # option said).
        self._logs: list[tuple[str, str, int, int]] = [
            (str(node), str(directory), int(log_id), int(size))
            for node, directory, log_id, size in json.loads(options["logs"])
        ]
        self._split = int(options.get("splitBytes", DEFAULT_SPLIT_BYTES))
        self._max_record = int(options.get("maxRecordBytes", ranges.DEFAULT_MAX_RECORD))

    def partitions(self) -> Sequence[InputPartition]:
        planned: list[InputPartition] = []
        for node, directory, log_id, snapshot_size in self._logs:
            if remote.is_url(directory):
                where = remote.join(directory, logformat.log_path(Path(), log_id).name)
                size = snapshot_size if snapshot_size >= 0 else UNKNOWN_SIZE_END
            else:
                path = logformat.log_path(Path(directory), log_id)
                where = str(path)
                try:
                    size = snapshot_size if snapshot_size >= 0 else path.stat().st_size
                except FileNotFoundError:
                    continue  # deleted while planning (a live node's GC)
            planned.extend(
                LogRange(node, log_id, where, start, end)
                for start, end in ranges.plan_ranges(size, self._split)
            )
        # Spark refuses a reader without partitions: one that reads nothing stands in.
        return planned or [LogRange("", -1, "", 0, 0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, LogRange)
        if partition.log_id < 0:
            return iter(())
        if remote.is_url(partition.path):
            return _scan_url(partition, self._max_record)
        return ranges.scan_range(
            Path(partition.path),
            partition.node,
            partition.log_id,
            partition.start,
            partition.end,
            self._max_record,
        )


def _scan_url(partition: LogRange, max_record: int) -> Iterator[pa.RecordBatch]:
    """The range over HTTP: the task's own connection pool, the CRCs checked here."""
    http = remote.pool()
    try:
        try:
            log = remote.HttpLog(http, partition.path)
        except FileNotFoundError:
            return  # not held by the snapshot (any more): nothing to read
        yield from ranges.scan_log(
            log, partition.node, partition.log_id, partition.start, partition.end, max_record
        )
    finally:
        http.clear()


class EntryLogDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return ranges.SPARK_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return EntryLogReader(self.options)


def read_records(spark: Any, logs: list[tuple[str, str, int, int]], split_bytes: int) -> Any:
    """The records DataFrame of the given (node, ledgers dir, log id, size) logs."""
    spark.dataSource.register(EntryLogDataSource)
    return (
        spark.read.format(FORMAT)
        .option("logs", json.dumps([list(log) for log in logs]))
        .option("splitBytes", str(split_bytes))
        .load()
    )


class TablePart(InputPartition):
    """One task: one node's file of a snapshot table (a path or a URL)."""

    def __init__(self, location: str) -> None:
        super().__init__(location)
        self.location = location


class SnapshotTableReader(DataSourceReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        self._table = str(options["table"])
        self._locations: list[str] = json.loads(options["locations"])

    def partitions(self) -> Sequence[InputPartition]:
        return [TablePart(location) for location in self._locations] or [TablePart("")]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, TablePart)
        if not partition.location:
            return iter(())
        return iter(read_table(self._table, partition.location).to_batches())


class SnapshotTableSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return TABLE_FORMAT

    def schema(self) -> str:
        return spark_schema(str(self.options["table"]))

    def reader(self, schema: StructType) -> DataSourceReader:
        return SnapshotTableReader(self.options)


def spark_schema(table: str) -> str:
    """The table's Spark DDL, from its Arrow schema (node.audit.tables.SCHEMAS)."""
    names = {
        pa.string(): "string",
        pa.int64(): "long",
        pa.bool_(): "boolean",
    }
    return ", ".join(f"{f.name} {names[f.type]}" for f in SCHEMAS[table])


def read_table(table: str, location: str) -> pa.Table:
    """One node's table, its columns in the current schema (those a snapshot predates as
    nulls), from ``location``: the snapshot's directory or URL."""
    name = f"{table}{PARQUET_SUFFIX}"
    if remote.is_url(location):
        http = remote.pool()
        try:
            found = pq.read_table(io.BytesIO(remote.get(http, remote.join(location, name))))
        finally:
            http.clear()
    else:
        found = pq.read_table(Path(location) / name)
    schema = SCHEMAS[table]
    columns = [
        found.column(f.name).cast(f.type)
        if f.name in found.column_names
        else pa.nulls(found.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def read_tables(spark: Any, locations: list[str]) -> dict[str, Any]:
    """Every table of the snapshots at ``locations`` (directories or URLs), one DataFrame
    per table over all of them."""
    spark.dataSource.register(SnapshotTableSource)
    return {
        name: spark.read.format(TABLE_FORMAT)
        .option("table", name)
        .option("locations", json.dumps(locations))
        .load()
        for name in SCHEMAS
    }
