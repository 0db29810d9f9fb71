"""``python -m node`` (also the ``storage-node`` script): serve, bench, inspect, audit, shell,
zone."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from node import logs, runtime
from node.settings import MiB, Settings, SettingsError, load
from node.sizing import fit_to_disks
from node.storage.dirlock import DataDirInUse, DataDirLock, DataDirUnusable, check_usable
from node.storage.errors import WalDeviceError

if TYPE_CHECKING:
    from node.replication.cookie import Cookie

LOOPBACK = ("127.0.0.1", "::1", "localhost")
# bench offload's defaults (here: the bench's module is imported only when it runs). The
# ledger is larger than the 64 MiB block cache and spans two blocks; moto reads a whole
# object for every ranged GET, so its share of the run grows with the square of the size:
# these keep the run under a minute on a 2-CPU VM.
OFFLOAD_LEDGER_MIB = 128
OFFLOAD_ENTRY_SIZE = 4096
OFFLOAD_RANDOM_READS = 300
# bench audit's: at least 1 GiB, so that a scan outweighs Spark's start; 64 MiB per task is the
# job's default.
AUDIT_GIB = 1.0
AUDIT_SPLIT_MIB = 64
DEFAULT_REPLAY_MIB = 256  # bench replay's journal
REREPLICATE_MIB = 64  # bench rereplicate's ledgers: ~3/4 of them on the lost node
JEPSEN_RUNS = 200  # bench jepsen's fault runs (make jepsen)
WRITE_BATCH = 100  # bench write's batched engine row: entries per add (the HTTP bench's shape)
READ_ENTRIES = 40_000  # the read rows' stream or ledger (the catch-up measurement)
READ_PAGE = 10_000  # ... read in pages of this many entries (a stream read's largest limit)


def _cmd_serve(args: argparse.Namespace) -> int:
    from node.http.app import serve

    settings = load(args.config, data_dir=args.data_dir, http_host=args.host, http_port=args.port)
    logs.setup(args.log_level or settings.log_level, args.log_json or settings.log_json)
    for deprecation in settings.deprecations:
        logging.getLogger("node.settings").warning("%s", deprecation)
    try:
        # Before the disks are sized: a file, /proc or a directory this user cannot enter
        # would be sized as a 0-byte disk or raise there.
        check_usable(settings.data_dir)
    except DataDirUnusable as e:
        raise StartRefused(str(e)) from None
    settings = fit_to_disks(settings)
    settings = runtime.fit_connections(settings, runtime.raise_open_files_limit())
    # Both refusals come before the first write: the port's needs none, and the lock is
    # the first file written (docs/internals.md, "Data directory").
    sockets = runtime.listen_sockets(settings.http_host, settings.http_port)
    try:
        lock = DataDirLock.acquire(settings.data_dir)
    except DataDirUnusable as e:
        for sock in sockets:
            sock.close()
        raise StartRefused(str(e)) from None
    except DataDirInUse as e:
        for sock in sockets:
            sock.close()
        raise StartRefused(
            f"{e}: stop that node first (or, for an audit, let it finish), or give this one "
            "another data directory (--data-dir, NODE_DATA_DIR)"
        ) from None
    if settings.http_host not in LOOPBACK and settings.admin_token is None:
        logging.getLogger("node").warning(
            "!!! listening on %s, which is not loopback, WITHOUT an admin token: anyone who "
            "can reach this port can write, delete ledgers and change the node's state. "
            "Set NODE_ADMIN_TOKEN. !!!",
            settings.http_host,
        )
    with lock:
        try:
            cookie = _check_cookie(settings)
        except StartRefused:
            for sock in sockets:
                sock.close()
            raise
        runtime.tune()
        runtime.dump_stacks_on_sigquit()
        runtime.run(serve(settings, sockets, cookie))
    return 0


def _check_cookie(settings: Settings) -> Cookie | None:
    """Who this data directory is (node/replication/cookie.py): after the lock, before the
    storage opens; the store's cookie, or None without a store (which must find none)."""
    from node.replication import cookie

    try:
        if not settings.metadata_url:
            cookie.check_without_store(settings)
            return None
        return runtime.run(_check_with_store(settings))
    except cookie.CookieRefused as e:
        raise StartRefused(str(e)) from None


async def _check_with_store(settings: Settings) -> Cookie:
    # Imported here: without a metadata store the node never loads node.client.
    from node.client.errors import ClientError
    from node.replication import cookie
    from node.replication.service import open_store

    try:
        store = open_store(settings)
    except ClientError as e:
        raise StartRefused(f"NODE_METADATA_URL: {e}") from None
    try:
        return await cookie.check(settings, store)
    except ClientError as e:
        raise StartRefused(
            f"cannot check this node's cookie in the metadata store at {settings.metadata_url}: "
            f"{e}. Start etcd (or fix NODE_METADATA_URL) first"
        ) from None
    finally:
        await store.close()


def _cmd_bench(args: argparse.Namespace) -> int:
    # Imported late (node.bench imports only the benchmark asked for): keeps `serve` light.
    from node.bench import main as bench_main

    return bench_main(args)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from node.inspect import main as inspect_main

    return inspect_main(args)


def _cmd_audit(args: argparse.Namespace) -> int:
    # Imported late: pyspark loads only for the audit, never for `serve`.
    from node.audit.job import run

    return run(args)


def _cmd_shell(args: argparse.Namespace) -> int:
    from node.shell import main as shell_main

    return shell_main(args.shell_argv)


def _cmd_zone(args: argparse.Namespace) -> int:
    from node.kubezone import run

    return run(args.node, args.output, args.api_url, args.token_dir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m node", description=__doc__)
    parser.add_argument("--log-level", help="debug, info, warning, error (NODE_LOG_LEVEL)")
    parser.add_argument("--log-json", action="store_true", help="JSON log lines (NODE_LOG_JSON)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the node")
    serve.add_argument("--config", type=Path, help="TOML or JSON file with settings")
    serve.add_argument("--data-dir", type=Path, help="overrides NODE_DATA_DIR")
    serve.add_argument("--host", help="overrides NODE_HTTP_HOST")
    serve.add_argument("--port", type=int, help="overrides NODE_HTTP_PORT")
    serve.set_defaults(func=_cmd_serve)

    bench = sub.add_parser("bench", help="measure the node against baselines on this disk")
    bench.add_argument(
        "what",
        choices=[
            "write",
            "http",
            "wal",
            "gc",
            "stream",
            "offload",
            "audit",
            "replay",
            "jepsen",
            "replicated",
            "rereplicate",
        ],
        help="write: the engine in-process; http: the live server over loopback; "
        "wal: the raw-device WAL against fio on a loop device and a file; "
        "gc: compaction throughput and its cost to concurrent adds; "
        "stream: stream appends and append-to-tailing-reader latency over loopback; "
        "offload: upload and reads of an offloaded ledger (local store, S3 on moto) "
        "against entry-log reads; "
        "audit: the audit's Spark scan of entry logs, local[1] and local[2], against inspect; "
        "replay: the start after a crash with a long journal, against reading it; "
        "jepsen: seeded fault runs against a local cluster, then the checker's verdict; "
        "replicated: E=3/Qw=3/Qa=2 ledgers against single-copy ones on a local cluster; "
        "rereplicate: autorecovery's copy of a lost node's fragments against a client's "
        "reads and adds of the same bytes",
    )
    bench.add_argument("--dir", type=Path, help="scratch directory (default: a temporary one)")
    bench.add_argument(
        "--writers", type=int, default=16, help="concurrent writers (http, stream: connections)"
    )
    bench.add_argument("--seconds", type=float, default=5.0, help="duration of each run")
    bench.add_argument(
        "--peer",
        choices=["redis"],
        help="http: the node beside this peer (Redis Streams, appendfsync always) instead",
    )
    bench.add_argument(
        "--rounds",
        type=int,
        help="http --peer: alternating rounds (default 3); audit: scans per runner, the best "
        "reported (default 2)",
    )
    bench.add_argument("--sizes", default="100,1024,65536", help="entry sizes in bytes")
    bench.add_argument("--window", type=int, default=64, help="adds in flight per writer")
    bench.add_argument(
        "--batch",
        type=int,
        default=WRITE_BATCH,
        help="write: entries per add_entries of the batched engine row, one batch in flight "
        "per writer (0: no such row)",
    )
    bench.add_argument(
        "--path", type=Path, help="wal: this block device or file only (overwritten)"
    )
    bench.add_argument(
        "--record-sizes", default="1024,16384,262144", help="wal: record sizes in bytes"
    )
    bench.add_argument(
        "--ledger-mib", type=int, default=OFFLOAD_LEDGER_MIB, help="offload: size of the ledger"
    )
    bench.add_argument(
        "--entry-size",
        type=int,
        default=OFFLOAD_ENTRY_SIZE,
        help="offload, audit, rereplicate: entry size in bytes",
    )
    bench.add_argument(
        "--random-reads",
        type=int,
        default=OFFLOAD_RANDOM_READS,
        help="offload: single-entry reads at random ids",
    )
    bench.add_argument(
        "--replay-mib", type=int, default=DEFAULT_REPLAY_MIB, help="replay: MiB of journal"
    )
    bench.add_argument("--gib", type=float, default=AUDIT_GIB, help="audit: GiB of entry logs")
    bench.add_argument(
        "--rereplicate-mib",
        type=float,
        default=REREPLICATE_MIB,
        help="rereplicate: MiB written before a node is lost",
    )
    bench.add_argument(
        "--split-mib", type=float, default=AUDIT_SPLIT_MIB, help="audit: MiB of log per task"
    )
    bench.add_argument(
        "--http",
        action="store_true",
        help="audit: the scan over HTTP from a node too, without and with its pace, and "
        "adds' p99 beside it",
    )
    bench.add_argument(
        "--pace-mib",
        type=float,
        default=Settings.model_fields["audit_serve_bytes_per_s"].default / MiB,
        help="audit --http: the node's pace (audit_serve_bytes_per_s) in MiB/s",
    )
    bench.add_argument(
        "--replicated",
        action="store_true",
        help="stream: replicated (3/3/2) streams on etcd and four local nodes against a "
        "single node's, and an append forwarded by a non-owner against the owner's",
    )
    bench.add_argument(
        "--dedup",
        action="store_true",
        help="stream (also --replicated): appends with producer headers (exactly-once) "
        "against the same without, alternating, with the node's CPU per entry",
    )
    bench.add_argument(
        "--rows",
        help="stream --replicated: appends, reads, tail; replicated: appends, reads "
        "(comma-separated; default: all)",
    )
    bench.add_argument(
        "--read-entries",
        type=int,
        default=READ_ENTRIES,
        help="stream --replicated, replicated: entries of 1 KiB the read rows read",
    )
    bench.add_argument(
        "--read-page",
        type=int,
        default=READ_PAGE,
        help="stream --replicated, replicated: entries per read request of the read rows",
    )
    bench.add_argument("--runs", type=int, default=JEPSEN_RUNS, help="jepsen: fault runs")
    bench.add_argument("--seed", type=int, default=0, help="jepsen: seed of the first run")
    bench.set_defaults(func=_cmd_bench)

    inspect = sub.add_parser("inspect", help="print and check a journal, entry log, index or WAL")
    inspect.add_argument("kind", choices=["journal", "entrylog", "index", "wal"])
    inspect.add_argument(
        "path", type=Path, help="a .txn or .log file, the index directory, or the WAL's device"
    )
    inspect.add_argument("--records", action="store_true", help="print every record")
    inspect.set_defaults(func=_cmd_inspect)

    from node.audit.job import add_arguments as audit_arguments  # argparse only, no pyspark

    audit = sub.add_parser("audit", help="audit the data with Spark (docs/operations.md: Audit)")
    audit_arguments(audit)
    audit.set_defaults(func=_cmd_audit)

    # The shell's own parser lives with it (node.shell): `serve` never loads the client.
    shell = sub.add_parser(
        "shell",
        add_help=False,
        help="replicated ledgers and nodes, for operators: listnodes, listledgers, "
        "ledgermetadata, readledger, recover, deleteledger, readd (docs/replication.md)",
    )
    shell.add_argument("shell_argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    shell.set_defaults(func=_cmd_shell)

    zone = sub.add_parser(
        "zone",
        help="write the Kubernetes node's topology.kubernetes.io/zone label to a file (the "
        "StatefulSet's init container; the node reads it as NODE_ZONE_FILE)",
    )
    zone.add_argument("--node", required=True, help="the node's name (the pod's spec.nodeName)")
    zone.add_argument("--output", type=Path, required=True, help="the file to write")
    zone.add_argument("--api-url", help="the API server (default: the in-cluster one)")
    zone.add_argument(
        "--token-dir",
        type=Path,
        default=Path("/var/run/secrets/kubernetes.io/serviceaccount"),
        help="the service account's token and ca.crt",
    )
    zone.set_defaults(func=_cmd_zone)
    return parser


class StartRefused(Exception):
    """The node cannot start as asked; the message says what to do (exit 2)."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "shell":  # its options before its first word are its own, not unknown
        args.shell_argv = unknown + args.shell_argv
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logs.setup(args.log_level or "info", args.log_json)
    try:
        return int(args.func(args))
    except (SettingsError, WalDeviceError, StartRefused, runtime.PortInUse) as e:
        print(f"refusing to start: {e}", file=sys.stderr)
        return 2
