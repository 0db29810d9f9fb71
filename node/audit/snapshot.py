"""A node's index and metadata as Parquet tables: what the audit joins against the entry logs.

Made two ways, the same tables either way:

- from a **stopped** node's data directory: the RocksDB index opened read-only (RocksDB's
  ``OpenForReadOnly`` takes no lock and changes no file), the entry logs' ledgers maps;
- from a **live** node (``POST /api/v1/audit/snapshot``): read between two checkpoints
  (``LedgerStorage.run_serialized``), so locations, metadata and the logs' ledger maps are
  those of one checkpoint.

Tables (every one has a ``node`` column, so that snapshots of a fleet stack up)::

    locations      node, ledger_id, entry_id, log_id, offset
    ledgers        node, ledger_id, state, lac, last_entry_id, entries, payload_bytes,
                   created_ms, closed_ms, stream, offload_state, offload_attempt,
                   offload_data_bytes, offload_local_deleted, writer_lac
    logs           node, log_id, size_bytes, mtime_ms, error       (error: unreadable log)
    log_ledgers    node, log_id, ledger_id, bytes                  (what GC counts per log)
    streams        node, stream, record                            (the stream record, JSON)
    cursors        node, stream, cursor, mark_ledger, mark_entry
    doomed         node, ledger_id, stream

plus ``snapshot.json`` (node name, the node's fleet id when it has a metadata store,
directories, time taken, the settings the checks need, the offload store's URL) and, for a
node with a metadata store, ``ledgers.json``: the replicated ledgers' metadata read just
before the snapshot (``node.audit.fleet``; the ``replicas`` check). Only pyarrow here: the
node imports this module, never pyspark.

A live node's snapshot **holds its logs**: hard links to them in its ``logs/`` directory,
which ``ledgersDir`` names, so that GC deleting a log, or compaction moving its records
into a new one, leaves the audit the log the snapshot's index points into (without them:
thousands of false ``index`` violations). A link costs nothing until GC deletes the
original; then the snapshot keeps its blocks, which is why the node keeps only the newest
``audit_snapshots_kept`` snapshots (``prune``). The current log, still appended to, is
linked too: the audit reads each log only up to the size the snapshot recorded.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from rocksdict import AccessType, Options, Rdict

from node.audit.kept import LEDGERS_FILE, LOGS_DIR, META_FILE, PARQUET_SUFFIX, TABLES, read_meta
from node.replication.cookie import read_local
from node.settings import Settings
from node.storage import entrylog, logformat
from node.storage.errors import CorruptRecord
from node.storage.index import (
    LEDGER_KEY,
    STREAM_PROPERTY,
    LedgerMeta,
    expand_runs,
)
from node.streams.model import CURSOR_PREFIX, DOOMED_PREFIX, STREAM_PREFIX, Cursor

if TYPE_CHECKING:
    import pyarrow as pa

    from node.storage.ledgers import LedgerStorage

# pyarrow (and node.audit.tables, built on it) is imported where a snapshot is built or
# fetched: a node that takes none starts without its ~0.1 s of imports.

FORMAT_VERSION = 1
INDEX_CURRENT_FILE = "CURRENT"  # every RocksDB directory has it
MS_PER_S = 1000
NS_PER_MS = 1_000_000


class SnapshotError(Exception):
    """The snapshot cannot be made or read (the audit exits 2 with this message)."""


@dataclass(slots=True)
class Snapshot:
    node: str
    ledgers_dir: str
    taken_ms: int
    settings: dict[str, Any]
    offload_store: str | None
    tables: dict[str, pa.Table] = field(default_factory=dict)
    node_id: str | None = None  # the fleet id (settings.id) of a node with a metadata store
    ledgers: bytes | None = None  # ledgers.json: the store's ledgers, read before the snapshot
    ledgers_error: str | None = None  # why there is none although the node has a store

    def meta(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "node": self.node,
            "nodeId": self.node_id,
            "ledgersFile": None if self.ledgers is None else LEDGERS_FILE,
            "ledgersError": self.ledgers_error,
            "ledgersDir": self.ledgers_dir,
            "takenMs": self.taken_ms,
            "settings": self.settings,
            "offloadStore": self.offload_store,
            "rows": {name: table.num_rows for name, table in self.tables.items()},
        }


def check_settings(settings: Settings) -> dict[str, Any]:
    """The node's settings the checks depend on (retention, compaction, log size)."""
    return {
        "majorCompactionIntervalS": settings.major_compaction_interval_s,
        "logSizeLimit": settings.log_size_limit,
        "defaultRetentionTimeInMinutes": settings.default_retention_time_in_minutes,
    }


def default_check_settings() -> dict[str, Any]:
    """The defaults, for a stopped node whose settings the audit is not told."""
    fields = Settings.model_fields
    return {
        "majorCompactionIntervalS": fields["major_compaction_interval_s"].default,
        "logSizeLimit": fields["log_size_limit"].default,
        "defaultRetentionTimeInMinutes": fields["default_retention_time_in_minutes"].default,
    }


def offload_store_url(settings: Settings) -> str | None:
    """The offload store as a URL the audit's executors open (obstore ``from_url``)."""
    if settings.offload_store == "local":
        root = settings.offload_dir
        if settings.offload_prefix:
            root = root / settings.offload_prefix
        return root.resolve().as_uri()
    prefix = f"/{settings.offload_prefix}" if settings.offload_prefix else ""
    return f"s3://{settings.offload_bucket}{prefix}"


# --- building the tables -------------------------------------------------------------------


class _Builder:
    """Column lists per table, turned into Arrow tables at the end."""

    def __init__(self, node: str) -> None:
        from node.audit.tables import SCHEMAS

        self.node = node
        self.columns: dict[str, dict[str, list[Any]]] = {
            name: {f.name: [] for f in schema} for name, schema in SCHEMAS.items()
        }

    def add(self, table: str, **values: Any) -> None:
        columns = self.columns[table]
        columns["node"].append(self.node)
        for key, value in values.items():
            columns[key].append(value)

    def add_locations(self, items: Iterable[tuple[int, int, int]]) -> None:
        columns = self.columns["locations"]
        node, lids, eids = columns["node"], columns["ledger_id"], columns["entry_id"]
        logs, offsets = columns["log_id"], columns["offset"]
        for ledger_id, entry_id, loc in items:
            node.append(self.node)
            lids.append(ledger_id)
            eids.append(entry_id)
            logs.append(loc >> 32)
            offsets.append(loc & 0xFFFF_FFFF)

    def add_ledger(self, meta: LedgerMeta) -> None:
        offload = meta.offload
        self.add(
            "ledgers",
            ledger_id=meta.ledger_id,
            state=meta.state.name,
            lac=meta.lac,
            last_entry_id=meta.last_entry_id,
            entries=meta.entries,
            payload_bytes=meta.payload_bytes,
            created_ms=meta.created_ms,
            closed_ms=meta.closed_ms,
            stream=meta.properties.get(STREAM_PROPERTY),
            offload_state=None if offload is None else offload.state.name,
            offload_attempt=None if offload is None else offload.attempt,
            offload_data_bytes=None if offload is None else offload.data_bytes,
            offload_local_deleted=None if offload is None else offload.local_deleted,
            writer_lac=meta.writer_lac,
        )

    def add_records(self, records: dict[bytes, bytes]) -> None:
        """The streams keyspace: stream records, cursors, doomed ledgers."""
        for key, value in sorted(records.items()):
            if key.startswith(STREAM_PREFIX):
                name = key.removeprefix(STREAM_PREFIX).decode()
                self.add("streams", stream=name, record=value.decode())
            elif key.startswith(CURSOR_PREFIX):
                cursor = Cursor.decode(key, value)
                self.add(
                    "cursors",
                    stream=cursor.stream,
                    cursor=cursor.name,
                    mark_ledger=cursor.mark_delete.ledger_id,
                    mark_entry=cursor.mark_delete.entry_id,
                )
            elif key.startswith(DOOMED_PREFIX):
                lid = int(key.removeprefix(DOOMED_PREFIX))
                self.add("doomed", ledger_id=lid, stream=json.loads(value)["stream"])

    def add_logs(self, ledgers_dir: Path, log_ids: Iterable[int]) -> None:
        """Each log's size, age (mtime) and GC's view of it: bytes per ledger from its
        ledgers map, or a scan for a log without one (what ``ledger_sizes`` gives GC)."""
        for log_id in log_ids:
            path = logformat.log_path(ledgers_dir, log_id)
            try:
                stat = path.stat()
                sizes = entrylog.ledger_sizes(path)
            except (OSError, CorruptRecord) as e:
                self.add("logs", log_id=log_id, size_bytes=0, mtime_ms=0, error=str(e))
                continue
            self.add(
                "logs",
                log_id=log_id,
                size_bytes=stat.st_size,
                mtime_ms=stat.st_mtime_ns // NS_PER_MS,
                error=None,
            )
            for ledger_id, size in sorted(sizes.items()):
                self.add("log_ledgers", log_id=log_id, ledger_id=ledger_id, bytes=size)

    def tables(self) -> dict[str, pa.Table]:
        import pyarrow as pa

        from node.audit.tables import SCHEMAS

        return {
            name: pa.table(self.columns[name], schema=schema) for name, schema in SCHEMAS.items()
        }


def open_index_read_only(path: Path) -> Rdict:
    """A stopped node's index, read-only (no lock taken, no file written)."""
    if not (path / INDEX_CURRENT_FILE).is_file():
        raise SnapshotError(f"{path}: not a RocksDB directory (no {INDEX_CURRENT_FILE})")
    try:
        families = Rdict.list_cf(str(path), Options(raw_mode=True))
        return Rdict(
            str(path),
            Options(raw_mode=True),
            column_families={name: Options(raw_mode=True) for name in families},
            access_type=AccessType.read_only(error_if_log_file_exist=False),
        )
    except Exception as e:  # rocksdict raises plain Exception
        raise SnapshotError(f"{path}: cannot open the index read-only: {e}") from None


def from_data_dir(
    data_dir: Path,
    node: str | None = None,
    settings: dict[str, Any] | None = None,
    offload_store: str | None = None,
    now_ms: int | None = None,
    node_id: str | None = None,
) -> Snapshot:
    """The snapshot of a stopped node's data directory (``ledgers/`` and ``index/``); its
    fleet id from ``node_id`` or else the directory's cookie (a replicated node's)."""
    ledgers_dir = data_dir / "ledgers"
    if not ledgers_dir.is_dir():
        raise SnapshotError(f"{data_dir}: no entry log directory {ledgers_dir}")
    name = node or str(data_dir.resolve())
    builder = _Builder(name)
    db = open_index_read_only(data_dir / "index")
    try:
        locations_cf = db.get_column_family("locations")
        ledgers_cf = db.get_column_family("ledgers")
        streams_cf = db.get_column_family("streams")
        builder.add_locations(expand_runs(locations_cf))
        for key, value in ledgers_cf.items():
            (ledger_id,) = LEDGER_KEY.unpack(cast(bytes, key))
            builder.add_ledger(LedgerMeta.decode(ledger_id, cast(bytes, value)))
        builder.add_records({cast(bytes, k): cast(bytes, v) for k, v in streams_cf.items()})
        del locations_cf, ledgers_cf, streams_cf  # they keep the database open
    finally:
        db.close()
    builder.add_logs(ledgers_dir, entrylog.list_logs(ledgers_dir))
    if offload_store is None and (data_dir / "offload").is_dir():
        offload_store = (data_dir / "offload").resolve().as_uri()
    if node_id is None:
        cookie = read_local(data_dir)
        node_id = None if cookie is None else cookie.node_id
    return Snapshot(
        name,
        str(ledgers_dir.resolve()),
        now_ms if now_ms is not None else _now_ms(),
        settings or default_check_settings(),
        offload_store,
        builder.tables(),
        node_id,
    )


def from_storage_serialized(
    ledgers_dir: Path,
    index: Any,
    ledgers: list[LedgerMeta],
    log_ids: list[int],
    node: str,
    settings: dict[str, Any],
    offload_store: str | None,
    now_ms: int,
) -> Snapshot:
    """The snapshot of a live node; called between two checkpoints (the caller runs it
    through ``LedgerStorage.run_serialized``), ``index`` being its ``Index``."""
    builder = _Builder(node)
    builder.add_locations(index.locations())
    for meta in ledgers:
        builder.add_ledger(meta)
    builder.add_records(index.records())
    builder.add_logs(ledgers_dir, log_ids)
    return Snapshot(
        node, str(ledgers_dir.resolve()), now_ms, settings, offload_store, builder.tables()
    )


def from_live_storage(storage: LedgerStorage, node: str, now_ms: int, directory: Path) -> Snapshot:
    """Blocking, on a worker thread: the snapshot of a running node at its last checkpoint,
    holding its logs in ``directory/logs`` (see the module's doc).

    It runs on the storage's flush thread between two checkpoints, so nothing appends to
    an entry log or writes a location meanwhile. Metadata comes from the index, not from
    memory: the in-memory ledgers are ahead of the last checkpoint (entries added since are
    in the write cache, not yet in a log), and the checks hold the two to each other. Logs
    that compaction is writing or has retired are left out: nothing indexes their records
    (yet, or any more)."""
    settings = storage.settings
    held = directory / LOGS_DIR

    def take() -> Snapshot:
        index = storage.index
        busy = {*storage.compactor.in_progress, *storage.retired_logs}
        log_ids = [i for i in entrylog.list_logs(settings.ledgers_dir) if i not in busy]
        return from_storage_serialized(
            held,
            index,
            list(index.load_ledgers().values()),
            hold_logs(settings.ledgers_dir, log_ids, held),
            node,
            check_settings(settings),
            offload_store_url(settings),
            now_ms,
        )

    return storage.run_serialized(take)


def hold_logs(ledgers_dir: Path, log_ids: list[int], held: Path) -> list[int]:
    """Hard-link each log, and the ledgers map GC may keep beside it, into ``held``; the ids
    linked (a log GC deleted since it was listed is left out, as if it had not been)."""
    held.mkdir(parents=True, exist_ok=True)
    linked = []
    for log_id in log_ids:
        source = logformat.log_path(ledgers_dir, log_id)
        try:
            os.link(source, logformat.log_path(held, log_id))
        except FileNotFoundError:
            continue
        except OSError as e:
            if e.errno == errno.EXDEV:
                raise SnapshotError(
                    f"the snapshot directory {held.parent} is not on the file system of the "
                    f"entry logs ({ledgers_dir}): it holds them by hard links"
                ) from None
            raise
        with contextlib.suppress(FileNotFoundError):
            os.link(logformat.map_file_path(source), logformat.map_file_path(held / source.name))
        linked.append(log_id)
    return linked


def _now_ms() -> int:
    return time.time_ns() // NS_PER_MS


# --- writing and reading -------------------------------------------------------------------


def table_bytes(table: pa.Table) -> bytes:
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def write_dir(snapshot: Snapshot, directory: Path) -> str:
    """Write the snapshot's files into ``directory``; returns its ``file://`` URI. Encoded
    in memory first, so that a full disk fails a plain write (ENOSPC in ``errno``)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in snapshot_files(snapshot).items():
        (directory / name).write_bytes(data)
    return directory.resolve().as_uri()


def snapshot_files(snapshot: Snapshot) -> dict[str, bytes]:
    """The snapshot's files by name, ``snapshot.json`` last (what marks one complete)."""
    files = {f"{n}{PARQUET_SUFFIX}": table_bytes(t) for n, t in snapshot.tables.items()}
    if snapshot.ledgers is not None:
        files[LEDGERS_FILE] = snapshot.ledgers
    files[META_FILE] = json.dumps(snapshot.meta(), indent=2).encode()
    return files


def fetch(uri: str, scratch: Path | None = None) -> Path:
    """A local directory holding the snapshot at ``uri``: a path or ``file://`` URI as is;
    of an ``http(s)://`` one (a node serving it), only its metadata, into ``scratch`` (the
    executors read its tables and logs from the node); anything else (``s3://...``)
    downloaded through obstore (credentials and endpoint from the standard ``AWS_*``
    variables) into ``scratch``."""
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    if "://" not in uri:
        local = Path(uri)
    elif uri.startswith("file://"):
        local = Path(uri.removeprefix("file://"))
    elif uri.startswith(("http://", "https://")):
        local = _download_http(uri, scratch)
    else:
        local = _download(uri, scratch)
    if not (local / META_FILE).is_file():
        raise SnapshotError(f"{uri}: not a snapshot (no {META_FILE})")
    meta = read_meta(local)
    if meta.get("version") != FORMAT_VERSION:
        raise SnapshotError(f"{uri}: snapshot version {meta.get('version')} is not supported")
    return local


def _download(uri: str, scratch: Path | None) -> Path:
    import obstore
    from obstore.store import from_url

    store = from_url(uri)
    target = Path(tempfile.mkdtemp(prefix="snapshot-", dir=scratch))
    names = [f"{n}{PARQUET_SUFFIX}" for n in TABLES] + [META_FILE]
    try:
        for name in names:
            (target / name).write_bytes(bytes(obstore.get(store, name).bytes()))
        ledgers = read_meta(target).get("ledgersFile")
        if ledgers:
            (target / ledgers).write_bytes(bytes(obstore.get(store, ledgers).bytes()))
    except Exception as e:  # obstore's errors: missing object, refused credentials
        raise SnapshotError(f"{uri}: cannot read the snapshot: {e}") from None
    return target


def _download_http(url: str, scratch: Path | None) -> Path:
    from node.audit import remote

    target = Path(tempfile.mkdtemp(prefix="snapshot-", dir=scratch))
    http = remote.pool()
    try:
        (target / META_FILE).write_bytes(remote.get(http, remote.join(url, META_FILE)))
        ledgers = read_meta(target).get("ledgersFile")
        if ledgers:
            (target / ledgers).write_bytes(remote.get(http, remote.join(url, ledgers)))
    except (OSError, ValueError) as e:  # the node's refusals, a connection that failed
        raise SnapshotError(f"{url}: cannot read the snapshot: {e}") from None
    finally:
        http.clear()
    return target
