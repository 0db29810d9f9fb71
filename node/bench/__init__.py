"""``python -m node bench WHAT``: the node measured against baselines on this machine.

- ``write`` (write.py): durable adds of the engine in-process, against the raw disk with the
  engine's batches and against RocksDB with a synced WAL;
- ``wal`` (wal.py): the raw-device WAL against fio on the same device;
- ``gc`` (gc.py): compaction throughput, and what throttled compaction costs the writers;
- ``http`` (http.py): the live server over loopback, next to the engine in-process;
- ``stream`` (stream.py): stream appends and append-to-tailing-reader latency over loopback;
  with ``--replicated`` (stream_replicated.py), replicated streams on a local cluster
  (etcd and four nodes) against a single node's: appends, a forwarded append, catch-up reads
  (stream_reads.py, the load process) and a tailing consumer's end-to-end latency;
- ``offload`` (offload.py): upload and reads of an offloaded ledger (local store, S3 on moto)
  beside entry-log reads of the same ledger, and the bytes a random read fetches;
- ``audit`` (audit.py): the audit's Spark scan of entry logs with local[1] and local[2]
  beside the single-threaded ``inspect`` CRC pass;
- ``replicated`` (replicated.py): replicated ledgers against single-copy ones through the
  client, on a local cluster (etcd and three nodes), and a closed ledger's reads through the
  client against one node's range reads;
- ``rereplicate`` (rereplicate.py): autorecovery's copy of a lost node's fragments through the
  nodes' route, against the same bytes read and added by a plain client (etcd and four nodes);
- ``jepsen`` (jepsen.py): seeded fault runs against etcd and five nodes on loopback, each
  checked against its history (node/jepsen/).

common.py holds what they all share; server.py what http and stream share (the node they
start, the load process they drive it with). A benchmark's module is imported only when it
runs, so that ``serve`` imports none of this.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from node.bench.common import EXIT_USAGE, UsageError


def main(args: argparse.Namespace) -> int:
    """Runs benchmark ``args.what`` (one of the CLI's choices): its module's ``main(args)``;
    ``stream --replicated`` is stream_replicated.py's (which builds on stream.py's load)."""
    what = args.what
    if what == "stream" and getattr(args, "replicated", False):
        what = "stream_replicated"
    benchmark = importlib.import_module(f"{__name__}.{what}")
    try:
        return int(benchmark.main(args))
    except UsageError as e:
        print(f"bench {args.what}: {e}", file=sys.stderr)
        return EXIT_USAGE
