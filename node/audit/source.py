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
tasks); each task reads its range on the executor and returns one row per record (see
``node.audit.ranges``), never a payload. The directories must be readable where the
executors run (local mode; on a cluster, executors on the node's volume).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from node.audit import ranges
from node.storage import logformat

FORMAT = "entrylog"
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
            path = logformat.log_path(Path(directory), log_id)
            try:
                size = snapshot_size if snapshot_size >= 0 else path.stat().st_size
            except FileNotFoundError:
                continue  # deleted while planning (a live node's GC)
            planned.extend(
                LogRange(node, log_id, str(path), start, end)
                for start, end in ranges.plan_ranges(size, self._split)
            )
        # Spark refuses a reader without partitions: one that reads nothing stands in.
        return planned or [LogRange("", -1, "", 0, 0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, LogRange)
        if partition.log_id < 0:
            return iter(())
        return ranges.scan_range(
            Path(partition.path),
            partition.node,
            partition.log_id,
            partition.start,
            partition.end,
            self._max_record,
        )


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
