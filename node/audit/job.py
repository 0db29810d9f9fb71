"""The audit job: ``python -m node audit ...`` or ``spark-submit node/audit/job.py ...``.

    --data-dir DIR     a stopped node's data directory (index read-only, entry logs; a live
                       node's is refused, its lock held during the audit); with
                       --snapshot, only where the entry logs are is taken from the snapshot
    --snapshot URI     a snapshot (POST /api/v1/audit/snapshot) instead; repeat for a fleet
    --out DIR          <out>/summary.json, <out>/<check>.parquet per check, log_usage.parquet
    --master M         Spark master (default: what spark-submit set, else local[*])
    --checks a,b       a subset of the checks (node.audit.CHECKS)
    --ledgers FILE     the replicated ledgers' metadata (node.audit.fleet's ledgers.json) for
                       snapshots that carry none (a stopped node's directory)
    --metadata-url U   dump it from the metadata store first (etcd://host:port/prefix)
    --post-to URL      then POST summary.json to URL/api/v1/audit/result (a node; the
                       bearer token from NODE_ADMIN_TOKEN when set)

Exit status: 0 every check clean, 1 a violation found, 2 the audit could not run (the
reason on stderr; also when --post-to could not deliver the summary).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from node.storage.dirlock import DataDirInUse, DataDirLock

EXIT_CLEAN = 0
EXIT_VIOLATIONS = 1
EXIT_CANNOT_RUN = 2
SUMMARY_FILE = "summary.json"
SUMMARY_VERSION = 1
DEFAULT_SPLIT_BYTES = 64 * 1024 * 1024
DEFAULT_GRACE_S = 24 * 3600  # retention runs daily (delete_when): a day late is not yet late
APP_NAME = "node-audit"
GATEWAY_ENV = "PYSPARK_GATEWAY_PORT"  # set by spark-submit for the Python it starts
DEFAULT_MASTER = "local[*]"  # nobody named one: this machine's cores
SHUFFLE_PARTITIONS = 8  # the tables are small next to the logs: few shuffle tasks
NS_PER_MS = 1_000_000
RESULT_PATH = "/api/v1/audit/result"
TOKEN_ENV = "NODE_ADMIN_TOKEN"  # the node's own setting: one secret for both sides
POST_TIMEOUT_S = 30.0


class CannotRun(Exception):
    """The audit cannot run (exit 2)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m node audit", description=__doc__)
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, help="a stopped node's data directory")
    parser.add_argument(
        "--snapshot", action="append", default=[], help="snapshot URI (repeatable: a fleet)"
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--master", help="Spark master, e.g. local[2], spark://host:7077")
    parser.add_argument("--checks", help="comma-separated subset of the checks")
    parser.add_argument(
        "--offload-store", help="offload store URL of a stopped node (default <data-dir>/offload)"
    )
    parser.add_argument(
        "--split-bytes", type=int, default=DEFAULT_SPLIT_BYTES, help="bytes of log per task"
    )
    parser.add_argument(
        "--retention-grace-s",
        type=int,
        default=DEFAULT_GRACE_S,
        help="how late retention may be before an out-of-retention ledger is a violation",
    )
    parser.add_argument("--now-ms", type=int, help="the audit's clock (default: now)")
    parser.add_argument(
        "--ledgers", type=Path, help="ledgers.json: replicated ledgers' metadata (replicas check)"
    )
    parser.add_argument(
        "--metadata-url", help="metadata store to dump the ledgers from first (replicas check)"
    )
    parser.add_argument(
        "--post-to", help="node URL (http://node:8080): POST the summary to its audit result"
    )


def spark_session(master: str | None) -> Any:
    """The active session (spark-submit's, a test's), or a new one. Executors run this
    interpreter and import this ``node`` package, wherever it lives."""
    root = str(Path(__file__).resolve().parents[2])
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is None:
        # spark-submit starts this interpreter through its gateway; its --name stays.
        submitted = GATEWAY_ENV in os.environ
        builder = (
            SparkSession.builder.master(master or submitted_master() or DEFAULT_MASTER)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", str(SHUFFLE_PARTITIONS))
        )
        # A cluster's executors import this node package from where the driver does (a
        # source checkout at the same path; an installed one needs nothing).
        builder = builder.config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
        token = os.environ.get(TOKEN_ENV)
        if token:  # executors read snapshots from the nodes (Spark redacts it in its UI)
            builder = builder.config(f"spark.executorEnv.{TOKEN_ENV}", token)
        active = (builder if submitted else builder.appName(APP_NAME)).getOrCreate()
    print(f"Spark master: {active.sparkContext.master}")
    return active


def submitted_master() -> str | None:
    """spark-submit's ``--master`` (or spark-defaults.conf's). It is in the JVM's system
    properties, which ``SparkConf`` reads only once the gateway to that JVM is up: before,
    ``SparkConf().contains("spark.master")`` is False even under spark-submit, and the
    audit of a cluster once ran in local mode without a word. Under spark-submit the JVM is
    spark-submit's own; otherwise this starts the one the session would start anyway."""
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()
    master = SparkConf().get("spark.master", None)
    return str(master) if master else None


def _wanted(text: str | None) -> list[str] | None:
    """The checks asked for; None: every check that can run."""
    from node.audit import CHECKS

    if not text:
        return None
    wanted = [c.strip() for c in text.split(",") if c.strip()]
    if not wanted:  # a summary of no check is no audit: the node refuses it
        raise CannotRun(f"--checks names no check; known: {', '.join(CHECKS)}")
    unknown = sorted(set(wanted) - set(CHECKS))
    if unknown:
        raise CannotRun(f"unknown checks {unknown}; known: {', '.join(CHECKS)}")
    return wanted


def _snapshot_dirs(args: argparse.Namespace, scratch: Path, now_ms: int) -> list[tuple[Path, str]]:
    """Each snapshot's local directory (its metadata at least) and where the executors
    read its tables: that directory, or the URL of a node serving it."""
    from node.audit import remote, snapshot

    if args.snapshot:
        return [
            (snapshot.fetch(uri, scratch), uri if remote.is_url(uri) else "")
            for uri in args.snapshot
        ]
    if args.data_dir is None:
        raise CannotRun("say --data-dir (a stopped node) or --snapshot URI")
    snap = snapshot.from_data_dir(args.data_dir, offload_store=args.offload_store, now_ms=now_ms)
    target = scratch / "snapshot"
    snapshot.write_dir(snap, target)
    return [(target, "")]


def run(args: argparse.Namespace, spark: Any | None = None) -> int:
    """The whole audit; returns the exit status."""
    try:
        wanted = _wanted(args.checks)
        return _run(args, wanted, spark)
    except CannotRun as e:
        print(f"audit could not run: {e}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except Exception as e:
        from node.audit.fleet import FleetError
        from node.audit.snapshot import SnapshotError

        if not isinstance(e, SnapshotError | FleetError | OSError):
            traceback.print_exc()
        print(f"audit could not run: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_CANNOT_RUN


def _own_data_dir(args: argparse.Namespace) -> contextlib.AbstractContextManager[object]:
    """The data directory's lock for the whole audit of it: a node running on it (or
    starting meanwhile) moves ledgers and logs under the scan, which then reports violations
    that are not (retention's first). A directory that is not one is left to the snapshot."""
    data_dir: Path | None = args.data_dir
    if args.snapshot or data_dir is None or not data_dir.is_dir():
        return contextlib.nullcontext()
    try:
        return DataDirLock.acquire(data_dir)
    except DataDirInUse as e:
        raise CannotRun(
            f"{e}, a running node: audit it through the node (POST /api/v1/audit/snapshot, "
            'then --snapshot with the uri it answers; docs/operations.md "Audit"), or stop it first'
        ) from None


def _run(args: argparse.Namespace, wanted: list[str] | None, spark: Any | None) -> int:
    with _own_data_dir(args):
        return _run_owned(args, wanted, spark)


def _ledgers_file(args: argparse.Namespace, out: Path) -> Path | None:
    """--ledgers, or the dump of --metadata-url into OUT/ledgers.json (taken before a
    --data-dir snapshot, so that a ledger CLOSED in it was closed before)."""
    from node.audit import fleet

    if args.ledgers is not None:
        return Path(args.ledgers)
    if not args.metadata_url:
        return None
    try:
        doc = fleet.dump_url(args.metadata_url)
    except Exception as e:  # the store's errors: the audit cannot run as asked
        raise CannotRun(f"cannot read the ledgers from {args.metadata_url}: {e}") from None
    path = out / fleet.LEDGERS_FILE
    path.write_bytes(fleet.encode(doc))
    return path


def _run_owned(args: argparse.Namespace, asked: list[str] | None, spark: Any | None) -> int:
    from node.audit import CHECKS, FLEET_CHECKS, checks, kept, remote, source

    started_ms = time.time_ns() // NS_PER_MS
    now_ms = args.now_ms if args.now_ms is not None else started_ms
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    ledgers_file = _ledgers_file(args, out)
    scratch = out / "_snapshots"
    found = _snapshot_dirs(args, scratch, now_ms)
    dirs = [d for d, _url in found]
    metas = [kept.read_meta(d) for d in dirs]
    for meta, (_d, url) in zip(metas, found, strict=True):
        if url:  # the node serves the logs it holds: the executors read them from it
            meta["ledgersDir"] = remote.join(url, kept.LOGS_DIR)
    if args.data_dir is not None and len(metas) == 1:
        # The logs are read where this machine sees them (a copied snapshot, a mount).
        metas[0]["ledgersDir"] = str((args.data_dir / "ledgers").resolve())
    has_metadata = ledgers_file is not None or any(m.get("ledgersFile") for m in metas)
    wanted = asked or [c for c in CHECKS if has_metadata or c not in FLEET_CHECKS]
    if not has_metadata and set(wanted) & set(FLEET_CHECKS):
        raise CannotRun(
            "the replicas check needs the ledgers' metadata: --ledgers FILE, --metadata-url, "
            "or snapshots of nodes with a metadata store"
        )
    spark = spark or spark_session(args.master)
    # Cached: each check joins them again, and a read goes through Python workers.
    tables = {
        name: df.cache()
        for name, df in source.read_tables(
            spark, [url or str(d.resolve()) for d, url in found]
        ).items()
    }
    records = source.read_records(spark, _snapshot_logs(tables["logs"], metas), args.split_bytes)
    records = records.cache()
    inputs = checks.Inputs(
        spark, records, tables, metas, now_ms, args.retention_grace_s * checks.MS_PER_S
    )
    results: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {}
    if "replicas" in wanted:
        inputs.expected, extra["replicas"] = _expected(spark, dirs, metas, tables, ledgers_file)
    else:
        print("replicas: not run (no ledger metadata: --ledgers or --metadata-url)")
    for name in wanted:
        if name == "garbage":
            df, usage = checks.check_garbage(inputs)
            usage_path = out / "log_usage.parquet"
            written = write_table(usage, usage_path)
            extra["garbage"] = {
                "logs": written.num_rows,
                "recordBytes": _total(written, "record_bytes"),
                "referencedBytes": _total(written, "referenced_bytes"),
                "gcLiveBytes": _total(written, "gc_live_bytes"),
                "garbageBytes": _total(written, "garbage_bytes"),
                "table": str(usage_path),
            }
        else:
            df = getattr(checks, f"check_{name}")(inputs)
        if name == "pinned":
            extra["logAges"] = checks.log_age_histogram(inputs)
        path = out / f"{name}.parquet"
        count = write_table(df, path).num_rows
        results[name] = {"violations": count, "table": str(path)}
    records.unpersist()
    for table in tables.values():
        table.unpersist()
    violations = sum(r["violations"] for r in results.values())
    summary = {
        "version": SUMMARY_VERSION,
        "startedMs": started_ms,
        "finishedMs": time.time_ns() // NS_PER_MS,
        "auditTimeMs": now_ms,
        "nodes": [m["node"] for m in metas],
        "status": "violations" if violations else "clean",
        "checks": results,
        **extra,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    _print_table(results)
    if args.post_to:
        post_summary(args.post_to, summary)
    return EXIT_VIOLATIONS if violations else EXIT_CLEAN


def write_table(df: Any, path: Path) -> Any:
    """The DataFrame, written by the driver (one Parquet file) and returned as an Arrow
    table: on a cluster the executors share no directory with the driver, and the tables
    of an audit (violations, one row per log) are small."""
    import pyarrow.parquet as pq

    table = df.toArrow()
    if path.is_dir():  # a run of an older job wrote a directory of parts
        shutil.rmtree(path)
    pq.write_table(table, path)
    return table


def _total(table: Any, column: str) -> int:
    import pyarrow.compute as pc

    return int(pc.sum(table.column(column)).as_py() or 0)


def _expected(
    spark: Any,
    dirs: list[Path],
    metas: list[dict[str, Any]],
    tables: dict[str, Any],
    ledgers_file: Path | None,
) -> tuple[Any, dict[str, Any]]:
    """The replicas check's input (what each node must hold, as a DataFrame) and what the
    summary says of it. Each snapshot's own ledgers.json first (read before it was taken),
    else the one given."""
    from pyspark.sql import functions as F

    from node.audit import checks, fleet

    given = fleet.read(ledgers_file) if ledgers_file is not None else None
    snapshots = {m["node"]: m["nodeId"] for m in metas if m.get("nodeId")}
    metadata: dict[str, list[Any]] = {}
    without: list[str] = []
    for directory, meta in zip(dirs, metas, strict=True):
        if not meta.get("nodeId"):
            continue  # a node without a metadata store holds no replica
        if meta.get("ledgersFile"):
            metadata[meta["node"]] = fleet.read(directory / meta["ledgersFile"])
        elif given is not None:
            metadata[meta["node"]] = given
        else:
            without.append(meta["nodeId"])
    ids = spark.createDataFrame(list(snapshots.items()), "node string, node_id string")
    ledgers = tables["ledgers"]
    if "writer_lac" not in ledgers.columns:
        ledgers = ledgers.withColumn("writer_lac", F.lit(-1))
    lacs = {
        (r["node_id"], r["ledger_id"]): r["writer_lac"]
        for r in ledgers.filter("writer_lac >= 0")
        .join(ids, "node")
        .select("node_id", "ledger_id", "writer_lac")
        .collect()
    }
    plan = fleet.expected_ranges(metadata, snapshots, lacs)
    rows = [
        (
            r.node,
            r.node_id,
            r.ledger_id,
            r.first,
            r.last,
            list(r.ensemble),
            r.ensemble_size,
            r.write_quorum,
        )
        for r in plan.ranges
    ]
    summary = {
        "ledgers": plan.ledgers,
        "ranges": len(rows),
        "openTailsCut": plan.open_tail_skipped,
        "nodesWithoutSnapshot": sorted(plan.nodes_without_snapshot),
        "nodesWithoutLedgers": sorted(without),
    }
    return spark.createDataFrame(rows, checks.EXPECTED_SCHEMA), summary


def _snapshot_logs(logs: Any, metas: list[dict[str, Any]]) -> list[tuple[str, str, int, int]]:
    """(node, ledgers dir, log id, size) of every log the snapshots list: the scan reads
    what each snapshot saw (a live node's logs grow after it), an unreadable log as it is
    now (-1) so that the scan reports what is wrong with it."""
    where = {m["node"]: m["ledgersDir"] for m in metas}
    rows = logs.select("node", "log_id", "size_bytes", "error").collect()
    return [
        (r["node"], where[r["node"]], r["log_id"], -1 if r["error"] else r["size_bytes"])
        for r in sorted(rows, key=lambda r: (r["node"], r["log_id"]))
    ]


def post_summary(url: str, summary: dict[str, Any]) -> None:
    """POST the summary to a node (which keeps it and exports it as metrics)."""
    import urllib.error
    import urllib.request

    from node.wire import JSON_CONTENT_TYPE

    headers = {"Content-Type": JSON_CONTENT_TYPE}
    token = os.environ.get(TOKEN_ENV)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    target = url.rstrip("/") + RESULT_PATH
    request = urllib.request.Request(
        target, data=json.dumps(summary).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=POST_TIMEOUT_S):
            pass
    except urllib.error.HTTPError as e:
        raise CannotRun(f"{target} refused the summary: {e.code} {e.read()[:300]!r}") from None
    except (urllib.error.URLError, OSError) as e:
        raise CannotRun(f"cannot post the summary to {target}: {e}") from None


def _print_table(results: dict[str, dict[str, Any]]) -> None:
    width = max(len("check"), *(len(n) for n in results))
    print(f"{'check':<{width}}  violations")
    for name, result in results.items():
        print(f"{name:<{width}}  {result['violations']}")
    total = sum(r["violations"] for r in results.values())
    print(f"{'total':<{width}}  {total}")


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":  # spark-submit node/audit/job.py ...
    sys.exit(main())
