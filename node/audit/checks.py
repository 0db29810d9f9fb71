"""The audit's checks, as Spark DataFrames over the entry log records and the snapshots.

Every check yields violation rows of one shape (``VIOLATION_SCHEMA``). The checks are
disjoint by construction, so that one fault shows in one check:

``index``      an index entry points at nothing (no log, or no record starts there) or at
               another record.
``crc``        a record fails its CRC32C.
``unindexed``  a record of a live ledger, CRC good, whose (ledger, entry) has no index entry
               at all (an index that lost an entry whose bytes are on disk).
``garbage``    a record of a live ledger that no index entry references while its
               (ledger, entry) is indexed, correctly, elsewhere: bytes GC counts as live (it
               sums ledgers maps) that nothing can ever read. Per log figures (record bytes,
               referenced bytes, GC's live bytes) go to the ``log_usage`` table.
``pinned``     a log older than retention + the major compaction interval, one row per live
               ledger that keeps it (GC deletes a log only when none of its ledgers lives).
``retention``  per stream: an acknowledged closed ledger that retention should have deleted
               more than ``grace`` ago and that is still there; backlog whose ledger is gone.
``offload``    an offloaded ledger whose objects disagree with its metadata.
``holes``      an entry id at or below a ledger's LAC that is neither indexed nor in any log.
``replicas``   fleet-wide, for replicated ledgers (their metadata from the metadata store,
               ``node.audit.fleet``): every node of an entry's write set must hold it, with
               the CRC32C the other copies have. ``missing``: no indexed copy on that node
               (or the node deleted the ledger); ``crc_mismatch``: its copy differs from
               the one most copies hold (a copy that fails its own CRC32C counts as
               different; with no majority every copy is named). Its table has two more
               columns, ``node_id`` (the fleet id) and ``kind``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from node.audit import offloadcheck
from node.streams.model import MINUTE_MS, Position, Stream
from node.streams.rules import plan_deletions

VIOLATION_SCHEMA = (
    "node string, ledger_id long, entry_id long, log_id long, offset long, what string"
)
MS_PER_S = 1000
HOUR_MS = 3600 * MS_PER_S
DAY_MS = 24 * HOUR_MS
# Upper bounds of the log age histogram in the summary (the last bucket is open).
AGE_BUCKETS_MS = (HOUR_MS, DAY_MS, 7 * DAY_MS, 30 * DAY_MS, 90 * DAY_MS)
AGE_BUCKET_NAMES = ("<1h", "<1d", "<7d", "<30d", "<90d", ">=90d")
OFFLOAD_TASKS_MAX = 64  # offloaded ledgers are spread over at most this many tasks


@dataclass(slots=True)
class Inputs:
    spark: SparkSession
    records: DataFrame
    tables: dict[str, DataFrame]  # the snapshot tables, every node's stacked
    metas: list[dict[str, Any]]  # snapshot.json of each node
    now_ms: int
    retention_grace_ms: int
    # The replicas check's input: what each node must hold (EXPECTED_SCHEMA rows, from
    # node.audit.fleet.expected_ranges); None when no ledger metadata was given.
    expected: DataFrame | None = None


EXPECTED_SCHEMA = (
    "node string, node_id string, ledger_id long, first long, last long, "
    "ensemble array<string>, ensemble_size int, write_quorum int"
)
REPLICAS_SCHEMA = f"{VIOLATION_SCHEMA}, node_id string, kind string"
MISSING = "missing"
CRC_MISMATCH = "crc_mismatch"


def _violations(df: DataFrame, what: Column, *extra: Column) -> DataFrame:
    return df.select(
        F.col("node"),
        F.col("ledger_id").cast("long"),
        F.col("entry_id").cast("long"),
        F.col("log_id").cast("long"),
        F.col("offset").cast("long"),
        what.alias("what"),
        *extra,
    )


def _live_ledgers(i: Inputs) -> DataFrame:
    """Ledgers whose entries must be readable from the logs: not deleted, local copy kept."""
    return i.tables["ledgers"].filter(
        (F.col("state") != "DELETED") & ~F.coalesce(F.col("offload_local_deleted"), F.lit(False))
    )


def _gc_live_ledgers(i: Inputs) -> DataFrame:
    """What GC counts live (``is_live_ledger``): known, deleted ones too until purged."""
    return i.tables["ledgers"].filter(~F.coalesce(F.col("offload_local_deleted"), F.lit(False)))


def _referenced(i: Inputs) -> DataFrame:
    """Records an index entry points at exactly (same place, same ledger and entry)."""
    loc = i.tables["locations"]
    return i.records.join(loc, ["node", "log_id", "offset", "ledger_id", "entry_id"], "left_semi")


def check_index(i: Inputs) -> DataFrame:
    loc = i.tables["locations"].alias("l")
    rec = i.records.alias("r")
    joined = loc.join(
        rec,
        (F.col("l.node") == F.col("r.node"))
        & (F.col("l.log_id") == F.col("r.log_id"))
        & (F.col("l.offset") == F.col("r.offset")),
        "left",
    )
    bad = joined.filter(
        F.col("r.ledger_id").isNull()
        | (F.col("r.ledger_id") != F.col("l.ledger_id"))
        | (F.col("r.entry_id") != F.col("l.entry_id"))
    )
    what = F.when(
        F.col("r.ledger_id").isNull(),
        F.lit("index entry points at nothing: no record starts there"),
    ).otherwise(
        F.format_string(
            "index entry points at another record (ledger %d entry %d)",
            F.col("r.ledger_id"),
            F.col("r.entry_id"),
        )
    )
    return _violations(bad.select("l.*", what.alias("w")), F.col("w"))


def check_crc(i: Inputs) -> DataFrame:
    bad = i.records.filter(~F.col("crc_ok"))
    return _violations(bad, F.format_string("record of %d bytes fails its CRC32C", F.col("size")))


def check_unindexed(i: Inputs) -> DataFrame:
    live = _live_ledgers(i).select("node", "ledger_id")
    found = (
        i.records.filter(F.col("crc_ok") & (F.col("ledger_id") >= 0))
        .join(live, ["node", "ledger_id"], "left_semi")
        .join(i.tables["locations"], ["node", "ledger_id", "entry_id"], "left_anti")
    )
    return _violations(found, F.lit("record of a live ledger with no index entry"))


def check_garbage(i: Inputs) -> tuple[DataFrame, DataFrame]:
    """(violations, per-log usage)."""
    referenced = _referenced(i)
    live = _live_ledgers(i).select("node", "ledger_id")
    valid_elsewhere = (
        i.tables["locations"]
        .join(
            referenced.select("node", "log_id", "offset", "ledger_id", "entry_id"),
            ["node", "log_id", "offset", "ledger_id", "entry_id"],
            "semi",
        )
        .select(
            "node",
            "ledger_id",
            "entry_id",
            F.col("log_id").alias("at_log"),
            F.col("offset").alias("at_offset"),
        )
    )
    orphans = (
        i.records.filter(F.col("ledger_id") >= 0)
        .join(live, ["node", "ledger_id"], "left_semi")
        .join(referenced, ["node", "log_id", "offset"], "left_anti")
        .join(valid_elsewhere, ["node", "ledger_id", "entry_id"])
    )
    violations = _violations(
        orphans,
        F.format_string(
            "unreferenced copy (%d bytes) that GC counts live; the index points at log %x "
            "offset %d",
            F.col("size"),
            F.col("at_log"),
            F.col("at_offset"),
        ),
    )
    entries = i.records.filter(F.col("ledger_id") >= 0)
    totals = entries.groupBy("node", "log_id").agg(F.sum("size").alias("record_bytes"))
    used = referenced.groupBy("node", "log_id").agg(F.sum("size").alias("referenced_bytes"))
    gc_live = (
        i.tables["log_ledgers"]
        .join(_gc_live_ledgers(i).select("node", "ledger_id"), ["node", "ledger_id"], "semi")
        .groupBy("node", "log_id")
        .agg(F.sum("bytes").alias("gc_live_bytes"))
    )
    usage = (
        i.tables["logs"]
        .select("node", "log_id", "size_bytes")
        .join(totals, ["node", "log_id"], "left")
        .join(used, ["node", "log_id"], "left")
        .join(gc_live, ["node", "log_id"], "left")
        .fillna(0, ["record_bytes", "referenced_bytes", "gc_live_bytes"])
        .withColumn("garbage_bytes", F.col("record_bytes") - F.col("referenced_bytes"))
    )
    return violations, usage


def pin_limit_ms(meta: dict[str, Any]) -> int:
    settings = meta["settings"]
    return int(
        settings["defaultRetentionTimeInMinutes"] * MINUTE_MS
        + settings["majorCompactionIntervalS"] * MS_PER_S
    )


def check_pinned(i: Inputs) -> DataFrame:
    limits = i.spark.createDataFrame(
        [(m["node"], pin_limit_ms(m)) for m in i.metas], "node string, limit_ms long"
    )
    old = (
        i.tables["logs"]
        .filter(F.col("error").isNull())
        .join(limits, "node")
        .withColumn("age_ms", F.lit(i.now_ms) - F.col("mtime_ms"))
        .filter(F.col("age_ms") > F.col("limit_ms"))
    )
    pins = old.join(i.tables["log_ledgers"], ["node", "log_id"]).join(
        _gc_live_ledgers(i).select("node", "ledger_id"), ["node", "ledger_id"], "semi"
    )
    pins = pins.withColumn("entry_id", F.lit(None)).withColumn("offset", F.lit(None))
    return _violations(
        pins,
        F.format_string(
            "log is %.1f days old (limit %.1f): ledger keeps %d bytes of it alive",
            F.col("age_ms") / DAY_MS,
            F.col("limit_ms") / DAY_MS,
            F.col("bytes"),
        ),
    )


def log_age_histogram(i: Inputs) -> dict[str, int]:
    ages = [
        i.now_ms - int(row["mtime_ms"])
        for row in i.tables["logs"].filter(F.col("error").isNull()).select("mtime_ms").collect()
    ]
    counts = dict.fromkeys(AGE_BUCKET_NAMES, 0)
    for age in ages:
        bucket = next(
            (n for n, bound in zip(AGE_BUCKET_NAMES, AGE_BUCKETS_MS, strict=False) if age < bound),
            AGE_BUCKET_NAMES[-1],
        )
        counts[bucket] += 1
    return counts


def retention_rows(
    streams: list[dict[str, Any]],
    cursors: list[dict[str, Any]],
    ledgers: dict[tuple[str, int], str],
    now_ms: int,
    grace_ms: int,
) -> list[tuple[str, int, None, None, None, str]]:
    """The stream rule on the driver (stream metadata is small): the node's own
    ``plan_deletions`` at the audit's time, given ``grace_ms`` for retention's schedule."""
    marks: dict[tuple[str, str], list[Position]] = {}
    for c in cursors:
        key = (c["node"], c["stream"])
        marks.setdefault(key, []).append(Position(c["mark_ledger"], c["mark_entry"]))
    rows: list[tuple[str, int, None, None, None, str]] = []
    for s in streams:
        node = s["node"]
        stream = Stream.decode(s["record"].encode())
        slowest = min(marks[(node, stream.name)]) if (node, stream.name) in marks else None
        infos = {info.ledger_id: info for info in stream.ledgers}
        time_limit_ms = stream.policies.retentionTimeInMinutes * MINUTE_MS
        for deletion in plan_deletions(stream, slowest, now_ms, forced=False):
            info = infos[deletion.ledger_id]
            overdue_ms = now_ms - info.closed_ms - max(time_limit_ms, 0)
            if deletion.reason == "time" and overdue_ms <= grace_ms:
                continue  # due, but retention runs on a schedule: not yet a violation
            if ledgers.get((node, deletion.ledger_id), "DELETED") == "DELETED":
                continue
            rows.append(
                (
                    node,
                    deletion.ledger_id,
                    None,
                    None,
                    None,
                    f"stream {stream.name}: acknowledged ledger out of retention "
                    f"({deletion.reason}, closed {(now_ms - info.closed_ms) / HOUR_MS:.1f} h "
                    "ago) is still present",
                )
            )
        if slowest is None:
            continue
        for info in stream.ledgers:
            backlog = info.ledger_id > slowest.ledger_id or (
                info.ledger_id == slowest.ledger_id and slowest.entry_id < info.entries - 1
            )
            if backlog and ledgers.get((node, info.ledger_id), "DELETED") == "DELETED":
                rows.append(
                    (
                        node,
                        info.ledger_id,
                        None,
                        None,
                        None,
                        f"stream {stream.name}: backlog ledger (after the slowest cursor "
                        f"{slowest}) is gone",
                    )
                )
    return rows


def check_retention(i: Inputs) -> DataFrame:
    streams = [r.asDict() for r in i.tables["streams"].collect()]
    cursors = [r.asDict() for r in i.tables["cursors"].collect()]
    stream_ledger_ids = {info["id"] for s in streams for info in json.loads(s["record"])["ledgers"]}
    ledgers = {
        (r["node"], r["ledger_id"]): r["state"]
        for r in i.tables["ledgers"]
        .filter(F.col("ledger_id").isin(list(stream_ledger_ids) or [-1]))
        .select("node", "ledger_id", "state")
        .collect()
    }
    rows = retention_rows(streams, cursors, ledgers, i.now_ms, i.retention_grace_ms)
    return i.spark.createDataFrame(rows, VIOLATION_SCHEMA)


def _offload_task(stores: dict[str, str]) -> Callable[[Any], list[Any]]:
    def check(rows: Any) -> list[Any]:
        opened: dict[str, Any] = {}
        found = []
        for row in rows:
            ledger = row.asDict()
            url = stores.get(ledger["node"])
            if url is None:
                found.append((ledger["node"], ledger["ledger_id"], "no offload store known"))
                continue
            store = opened.get(url) or opened.setdefault(url, offloadcheck.open_store(url))
            found.extend(
                (ledger["node"], ledger["ledger_id"], problem)
                for problem in offloadcheck.check_ledger(store, ledger)
            )
        return found

    return check


def check_offload(i: Inputs) -> DataFrame:
    stores = {m["node"]: m["offloadStore"] for m in i.metas if m.get("offloadStore")}
    offloaded = i.tables["ledgers"].filter(
        (F.col("offload_state") == "OFFLOADED") & (F.col("state") != "DELETED")
    )
    tasks = max(1, min(OFFLOAD_TASKS_MAX, i.spark.sparkContext.defaultParallelism))
    found = offloaded.repartition(tasks).rdd.mapPartitions(_offload_task(stores))
    df = i.spark.createDataFrame(found, "node string, ledger_id long, what string")
    return _violations(
        df.withColumn("entry_id", F.lit(None))
        .withColumn("log_id", F.lit(None))
        .withColumn("offset", F.lit(None)),
        F.col("what"),
    )


def check_holes(i: Inputs) -> DataFrame:
    ledgers = _live_ledgers(i).filter(F.col("lac") >= 0).select("node", "ledger_id", "lac")
    present = (
        i.tables["locations"]
        .select("node", "ledger_id", "entry_id")
        .unionByName(
            i.records.filter(F.col("crc_ok") & (F.col("ledger_id") >= 0)).select(
                "node", "ledger_id", "entry_id"
            )
        )
        .distinct()
        .join(ledgers, ["node", "ledger_id"])
        .filter(F.col("entry_id") <= F.col("lac"))
    )
    counts = present.groupBy("node", "ledger_id").agg(F.count("*").alias("present"))
    short = (
        ledgers.join(counts, ["node", "ledger_id"], "left")
        .fillna(0, ["present"])
        .filter(F.col("present") < F.col("lac") + 1)
    )
    missing = short.select(
        "node",
        "ledger_id",
        "lac",
        F.explode(F.sequence(F.lit(0).cast("long"), "lac")).alias("entry_id"),
    ).join(
        present.select("node", "ledger_id", "entry_id"), ["node", "ledger_id", "entry_id"], "anti"
    )
    missing = missing.withColumn("log_id", F.lit(None)).withColumn("offset", F.lit(None))
    return _violations(
        missing,
        F.format_string("entry at or below LAC %d is neither indexed nor in any log", F.col("lac")),
    )


def check_replicas(i: Inputs) -> DataFrame:
    if i.expected is None:
        return i.spark.createDataFrame([], REPLICAS_SCHEMA)
    # Entries of each node's ranges whose write set holds the node: the node at position p
    # of the ensemble holds entry e when (p - e) mod E < Qw (e's write set is Qw consecutive
    # nodes from e mod E).
    position = F.array_position("ensemble", F.col("node_id")) - 1
    expected = (
        i.expected.select(
            "node",
            "node_id",
            "ledger_id",
            "first",
            "ensemble",
            "ensemble_size",
            "write_quorum",
            F.explode(F.sequence("first", "last")).alias("entry_id"),
        )
        .withColumn("position", position)
        .filter(
            F.pmod(F.col("position") - F.col("entry_id"), F.col("ensemble_size"))
            < F.col("write_quorum")
        )
    )
    live = i.tables["ledgers"].filter(F.col("state") != "DELETED").select("node", "ledger_id")
    held = (
        _referenced(i)
        .join(live, ["node", "ledger_id"], "left_semi")
        .select("node", "ledger_id", "entry_id", "log_id", "offset", "crc", "crc_ok")
    )
    copies = expected.join(held, ["node", "ledger_id", "entry_id"], "left")
    write_set = F.expr(
        "concat_ws(',', transform(sequence(0, write_quorum - 1), "
        "k -> ensemble[cast(pmod(entry_id + k, ensemble_size) as int)]))"
    )
    missing = _replica_violations(
        copies.filter(F.col("crc").isNull()),
        F.format_string(
            "missing: node %s holds no copy (write set %s of the segment from entry %d)",
            F.col("node_id"),
            write_set,
            F.col("first"),
        ),
        MISSING,
    )
    present = copies.filter(F.col("crc").isNotNull())
    # The reference copy of each entry: the CRC most copies that pass their own CRC32C
    # have; a tie between the first two is no reference at all.
    groups = present.groupBy("ledger_id", "entry_id", "crc").agg(
        F.count("*").alias("n"), F.max(F.col("crc_ok").cast("int")).alias("ok")
    )
    entry = Window.partitionBy("ledger_id", "entry_id")
    ranked = entry.orderBy(F.desc("ok"), F.desc("n"), "crc")
    reference = (
        groups.withColumn("rank", F.row_number().over(ranked))
        .withColumn("copies", F.sum("n").over(entry))
        .withColumn(
            "tie",
            F.coalesce(
                (F.lead("ok").over(ranked) == F.col("ok"))
                & (F.lead("n").over(ranked) == F.col("n")),
                F.lit(False),
            ),
        )
        .filter(F.col("rank") == 1)
        .select(
            "ledger_id",
            "entry_id",
            "copies",
            "tie",
            F.col("crc").alias("ref_crc"),
            F.col("n").alias("ref_n"),
        )
    )
    bad = present.join(reference, ["ledger_id", "entry_id"]).filter(
        (F.col("crc") != F.col("ref_crc")) | F.col("tie") | ~F.col("crc_ok")
    )
    detail = (
        F.when(
            F.col("tie"),
            F.format_string("copies disagree with no majority (%d copies)", F.col("copies")),
        )
        .when(
            F.col("crc") != F.col("ref_crc"),
            F.format_string(
                "%d of %d copies have CRC32C %08x",
                F.col("ref_n"),
                F.col("copies"),
                F.col("ref_crc"),
            ),
        )
        .otherwise(F.lit("the other copies agree with it"))
    )
    mismatch = _replica_violations(
        bad,
        F.format_string(
            "crc_mismatch: node %s's copy has CRC32C %08x%s; %s",
            F.col("node_id"),
            F.col("crc"),
            F.when(F.col("crc_ok"), F.lit("")).otherwise(F.lit(" and fails its own check")),
            detail,
        ),
        CRC_MISMATCH,
    )
    return missing.unionByName(mismatch)


def _replica_violations(df: DataFrame, what: Column, kind: str) -> DataFrame:
    """VIOLATION_SCHEMA's columns, then the node's fleet id and the kind."""
    return _violations(df, what, F.col("node_id"), F.lit(kind).alias("kind"))
