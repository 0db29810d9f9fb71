"""``make cluster`` (``python -m node.devcluster``): etcd and four nodes on loopback, data under
``./cluster/``, in the foreground, to try replicated ledgers by hand. It prints the metadata
store's URL, each node's URL and log, the line that points the shell at them and how to stop
and start one node; Ctrl-C (or SIGTERM) stops them all. Started again on the same directory,
the same cluster comes back: same node ids, cookies and ledgers (new ports: the nodes register
their new URLs).

Four nodes by default: a 3/3/2 ledger (the default replication of streams) needs three
writable nodes, so with four a node can be lost, and its copies made again, while the fleet
goes on taking appends.

While it runs it says when a node or etcd exits, and takes orders for one process at a time
from ``python -m node.devcluster node ID ACTION`` (``make cluster-node ID=n1 DO=stop``): it
serves them on a loopback port named in ``<root>/devcluster.json``, which also holds the
metadata store's and the nodes' URLs (``make airflow`` reads them). A node started again
comes back on its port and data directory, as the cluster's child: Ctrl-C stops it too."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

from node.localcluster import LocalCluster, ProcessExited, free_port

DEFAULT_ROOT = Path("cluster")
DEFAULT_NODES = 4
VENV_PYTHON = Path(".venv/bin/python")  # make's venv, when run from the repository
WATCH_INTERVAL_S = 1.0  # how often the nodes and etcd are looked at, to say when one exits
STATE_FILE = "devcluster.json"  # in the root: the running cluster's addresses, for its tools
ETCD = "etcd"  # the id that names etcd in an order
ACTIONS = ("start", "stop", "kill", "restart")
# An order waits for a node's start (localcluster.READY_TIMEOUT_S) and etcd's, with room.
ORDER_TIMEOUT_S = 90.0
OK, REFUSED, FAILED = 200, 409, 500


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the cluster as Ctrl-C does


def describe(cluster: LocalCluster, root: Path) -> list[str]:
    """What the operator needs: the URLs, the logs, the shell against them, one node's stop
    and start."""
    python = str(VENV_PYTHON) if VENV_PYTHON.exists() else "python"
    lines = [f"metadata store: {cluster.metadata_url}  (etcd's data and log: {root / 'etcd'})"]
    lines += [
        f"node {node_id}: {cluster.url(node_id)}  (data: {root / node_id}, "
        f"log: {root / node_id}.log)"
        for node_id in cluster.node_ids
    ]
    last = cluster.node_ids[-1]
    lines += [
        "",
        "in another shell, from this directory (paste the export line as it is: the ports",
        "are chosen at each start):",
        f"  export NODE_METADATA_URL={cluster.metadata_url}",
        f"  {python} -m node shell listnodes",
        "",
        f"one node (or {ETCD}) at a time, back on its port and data: make cluster-node "
        f"ID={last} DO=stop (DO=kill: SIGKILL), then make cluster-node ID={last}",
        "",
        "Ctrl-C stops them all.",
    ]
    return lines


class Supervisor:
    """The running cluster: what it says when a process exits, and the orders it takes."""

    def __init__(self, cluster: LocalCluster, root: Path) -> None:
        self.cluster = cluster
        self.root = root
        self.lock = threading.Lock()  # one order or one look at a time
        self.reported: set[str] = set()  # exits already said (or ordered)

    def watch(self) -> None:
        """Says once when a node or etcd exited without being told to."""
        with self.lock:
            for node_id in self.cluster.node_ids:
                proc = self.cluster.node(node_id).proc
                if proc is not None and proc.poll() is not None and node_id not in self.reported:
                    self.reported.add(node_id)
                    print(
                        f"node {node_id} exited with {proc.returncode}; its log: "
                        f"{self.root}/{node_id}.log; `make cluster-node ID={node_id}` starts "
                        "it again",
                        flush=True,
                    )
            etcd = self.cluster.etcd.proc
            if etcd is not None and etcd.poll() is not None and ETCD not in self.reported:
                self.reported.add(ETCD)
                print(
                    f"etcd exited with {etcd.returncode}: the nodes have lost their metadata "
                    "store (no new ledgers, no appends to replicated streams, no registration)"
                    f"; its log: {self.cluster.etcd.log_path}; `make cluster-node ID={ETCD}` "
                    "starts it again on the same port and data, Ctrl-C stops the cluster",
                    file=sys.stderr,
                    flush=True,
                )

    def order(self, target: str, action: str) -> tuple[int, str]:
        """Carries out ``action`` on a node or etcd: (HTTP status, what happened)."""
        if action not in ACTIONS:
            return REFUSED, f"unknown action {action!r}: one of {', '.join(ACTIONS)}"
        if target != ETCD and target not in self.cluster.node_ids:
            known = ", ".join([*self.cluster.node_ids, ETCD])
            return REFUSED, f"no node {target!r} in this cluster: one of {known}"
        with self.lock:
            try:
                said = self._order(target, action)
            except (ProcessExited, RuntimeError) as e:
                return FAILED, f"{target}: {e}"
            self.reported.add(target)  # an ordered stop is no news; a start clears it below
            if action in ("start", "restart"):
                self.reported.discard(target)
        print(said, flush=True)
        return OK, said

    def _order(self, target: str, action: str) -> str:
        cluster = self.cluster
        if target == ETCD:
            if action == "stop":
                cluster.etcd.stop()
                return "etcd stopped (SIGTERM)"
            if action == "kill":
                cluster.kill_etcd()
                return "etcd killed (SIGKILL)"
            running = cluster.etcd.proc is not None and cluster.etcd.proc.poll() is None
            if action == "start" and running:
                raise RuntimeError("etcd is running")
            cluster.restart_etcd()
            return f"etcd started: {cluster.metadata_url}"
        node = cluster.node(target)
        if action == "stop":
            cluster.terminate(target)
            return f"node {target} stopped (SIGTERM)"
        if action == "kill":
            cluster.kill(target)
            return f"node {target} killed (SIGKILL)"
        if action == "restart":
            cluster.restart(target)
        else:
            cluster.start(target)
        return f"node {target} started: {node.url} (pid {node.proc.pid if node.proc else '?'})"

    def serve(self) -> HTTPServer:
        """The orders' endpoint, POST /<target>/<action>, on a loopback port, in a thread."""
        supervisor = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                parts = self.path.strip("/").split("/")
                status, text = (
                    supervisor.order(*parts) if len(parts) == 2 else (REFUSED, "POST /ID/ACTION")
                )
                body = text.encode() + b"\n"
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the order's outcome is printed instead

        server = HTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=server.serve_forever, name="orders", daemon=True).start()
        return server


def write_state(root: Path, cluster: LocalCluster, control: str) -> Path:
    """``<root>/devcluster.json``: written whole, then renamed (a reader never sees half)."""
    path = root / STATE_FILE
    state = {
        "pid": os.getpid(),
        "control": control,
        "metadataUrl": cluster.metadata_url,
        "nodes": {node_id: cluster.url(node_id) for node_id in cluster.node_ids},
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(path)
    return path


def read_state(root: Path) -> dict[str, Any] | None:
    """The state of the cluster running under ``root``, or None when none runs there (no
    file, or its process is gone: a cluster killed with SIGKILL leaves its file)."""
    try:
        state: dict[str, Any] = json.loads((root / STATE_FILE).read_text())
        os.kill(int(state["pid"]), 0)
    except (OSError, ValueError, KeyError):
        return None
    return state


def send_order(root: Path, target: str, action: str) -> int:
    """``node ID ACTION``: the order to the cluster running under ``root``; its exit status."""
    state = read_state(root)
    if state is None:
        print(
            f"no `make cluster` is running under {root}/ (no {root / STATE_FILE} of a live "
            "process): start it first",
            file=sys.stderr,
        )
        return 1
    request = urllib.request.Request(f"{state['control']}/{target}/{action}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=ORDER_TIMEOUT_S) as reply:
            print(reply.read().decode().rstrip())
            return 0
    except urllib.error.HTTPError as e:
        print(e.read().decode(errors="replace").rstrip(), file=sys.stderr)
    except (urllib.error.URLError, OSError) as e:
        print(f"the cluster under {root}/ did not answer: {e}", file=sys.stderr)
    return 1


def run(root: Path, nodes: int) -> int:
    # SIGINT too: a process started with SIGINT ignored (by a parent that ignores it, as
    # pytest-xdist's workers do) inherits that, and Python then leaves it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    print(f"starting etcd and {nodes} nodes under {root}/ ...", flush=True)
    try:
        cluster = LocalCluster(root.resolve(), nodes=nodes)
    except (ProcessExited, RuntimeError, FileNotFoundError) as e:
        print(f"cluster: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130  # LocalCluster stopped what it had started
    supervisor = Supervisor(cluster, root)
    server: HTTPServer | None = None
    state: Path | None = None
    try:
        server = supervisor.serve()
        state = write_state(root, cluster, f"http://127.0.0.1:{server.server_port}")
        print("\n".join(describe(cluster, root)), flush=True)
        while True:
            time.sleep(WATCH_INTERVAL_S)
            supervisor.watch()
    except KeyboardInterrupt:
        print("\nstopping the nodes and etcd ...", flush=True)
    finally:
        if state is not None:
            state.unlink(missing_ok=True)
        if server is not None:
            server.shutdown()
        with supervisor.lock:  # an order under way finishes first
            cluster.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node.devcluster", description=__doc__)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="data of all processes")
    parser.add_argument("--nodes", type=int, default=DEFAULT_NODES, help="how many nodes")
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("node", help="stop or start one node (or etcd) of the running cluster")
    one.add_argument("id", help=f"a node's id (n0, n1, ...) or {ETCD}")
    one.add_argument("action", choices=ACTIONS, nargs="?", default="start")
    args = parser.parse_args(argv)
    if args.command == "node":
        return send_order(args.root, args.id, args.action)
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    return run(args.root, args.nodes)


if __name__ == "__main__":
    raise SystemExit(main())
