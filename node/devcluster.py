"""``make cluster`` (``python -m node.devcluster``): etcd and three nodes on loopback, data under
``./cluster/``, in the foreground, to try replicated ledgers by hand. It prints the metadata
store's URL, each node's URL and log, and how to point the shell at them; Ctrl-C (or SIGTERM)
stops them all. Started again on the same directory, the same cluster comes back: same node
ids, cookies and ledgers (new ports: the nodes register their new URLs)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from node.localcluster import LocalCluster, ProcessExited

DEFAULT_ROOT = Path("cluster")
DEFAULT_NODES = 3
VENV_PYTHON = Path(".venv/bin/python")  # make's venv, when run from the repository
WATCH_INTERVAL_S = 1.0  # how often the nodes are looked at, to say when one exits


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the cluster as Ctrl-C does


def describe(cluster: LocalCluster, root: Path) -> list[str]:
    """What the operator needs: the URLs, the logs, and the shell against them."""
    python = str(VENV_PYTHON) if VENV_PYTHON.exists() else "python"
    lines = [f"metadata store: {cluster.metadata_url}  (etcd's data and log: {root / 'etcd'})"]
    lines += [
        f"node {node_id}: {cluster.url(node_id)}  (data: {root / node_id}, "
        f"log: {root / node_id}.log)"
        for node_id in cluster.node_ids
    ]
    lines += [
        "",
        "in another shell, from this directory:",
        f"  export NODE_METADATA_URL={cluster.metadata_url}",
        f"  {python} -m node shell listnodes",
        "",
        "Ctrl-C stops them all.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node.devcluster", description=__doc__)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="data of all processes")
    parser.add_argument("--nodes", type=int, default=DEFAULT_NODES, help="how many nodes")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    root: Path = args.root
    # SIGINT too: a process started with SIGINT ignored (by a parent that ignores it, as
    # pytest-xdist's workers do) inherits that, and Python then leaves it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    print(f"starting etcd and {args.nodes} nodes under {root}/ ...", flush=True)
    try:
        cluster = LocalCluster(root.resolve(), nodes=args.nodes)
    except (ProcessExited, RuntimeError, FileNotFoundError) as e:
        print(f"cluster: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130  # LocalCluster stopped what it had started
    try:
        print("\n".join(describe(cluster, root)), flush=True)
        reported: set[str] = set()
        while True:
            time.sleep(WATCH_INTERVAL_S)
            for node_id in cluster.node_ids:
                node = cluster.node(node_id)
                if not node.alive() and node_id not in reported and node.proc is not None:
                    reported.add(node_id)
                    print(
                        f"node {node_id} exited with {node.proc.returncode}; its log: "
                        f"{root}/{node_id}.log",
                        flush=True,
                    )
    except KeyboardInterrupt:
        print("\nstopping the nodes and etcd ...", flush=True)
    finally:
        cluster.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
