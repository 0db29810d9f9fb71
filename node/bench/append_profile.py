"""``python -m node.bench.append_profile``: where the CPU of replicated single appends goes.

Starts etcd and ``--nodes`` nodes on loopback (as ``bench stream --replicated``), creates a
3/3/2 stream through n0, runs ``bench stream``'s single-append load against its owner for
``--seconds`` with ``--writers`` connections, and prints the CPU milliseconds each process
used per acknowledged append: CPU time is what a loaded, shared machine does not distort,
unlike wall-clock rates. Each node is labelled by its part in the stream's ledgers: the owner
(the writer), a replica (in the ensemble), both, or idle.

``--py-spy PATH`` (a py-spy binary) also samples the owner and one replica during the load
and prints the functions taking the most CPU in each (self and inclusive), from py-spy's
collapsed stacks; ``--keep DIR`` keeps them there.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from node.bench.server import CLOCK_TICKS, ENTRY_SIZE, WARMUP_S, call
from node.bench.stream import POLICIES, SINGLE
from node.bench.stream_replicated import REPLICATION, owner_of
from node.client.model import ledger_key
from node.localcluster import LocalCluster
from node.wire import JSON_CONTENT_TYPE, OCTET_CONTENT_TYPE

LOAD_MODULE = "node.bench.stream"
STREAM = "profiled"
SPY_RATE = 200  # py-spy samples per second
TOP = 25  # functions listed per profile


def _roles(cluster: LocalCluster, owner: str) -> dict[str, str]:
    """Each node's part in the stream's ledgers."""
    raw = cluster.etcd.get(f"/{cluster.prefix}/streams/{STREAM}")
    holders: set[str] = set()
    for info in json.loads(raw or b"{}").get("ledgers", []):
        meta = cluster.etcd.get(f"/{cluster.prefix}/{ledger_key(info['id'])}")
        for segment in json.loads(meta or b"{}").get("segments", []):
            holders.update(segment["ensemble"])
    roles = {}
    for node in cluster.node_ids:
        parts = [p for p, yes in (("owner", node == owner), ("replica", node in holders)) if yes]
        roles[node] = "+".join(parts) or "idle"
    return roles


def _cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def _minus(after: tuple[float, float], before: tuple[float, float]) -> tuple[float, float]:
    return after[0] - before[0], after[1] - before[1]


def _stored(url: str) -> tuple[float, float]:
    """(entries added, POST requests answered) by a node so far, from its /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    adds = requests = 0.0
    for line in lines:
        if line.startswith("storage_node_adds_total "):
            adds += float(line.rsplit(" ", 1)[1])
        elif line.startswith("storage_node_http_request_duration_seconds_count{") and (
            'method="POST"' in line
        ):
            requests += float(line.rsplit(" ", 1)[1])
    return adds, requests


def _frame(text: str) -> str:
    """``function (path/file.py:line)`` as ``function file.py:line``."""
    return text.split(" (")[0] + " " + text.rsplit("/", 1)[-1].rstrip(")")


def _top(collapsed: Path) -> list[str]:
    """The TOP functions by self and by inclusive samples of py-spy's collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        frames = [_frame(f) for f in stack.split(";")]
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    lines = [f"  {total} samples; self:"]
    lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(TOP)]
    lines.append("  inclusive:")
    lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in inclusive.most_common(TOP * 2)]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--py-spy", dest="py_spy", default="")
    parser.add_argument("--keep", default="")
    parser.add_argument("--gil", action="store_true", help="sample only the GIL's holder")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="node-append-profile-") as scratch:
        out = Path(args.keep or scratch)
        out.mkdir(parents=True, exist_ok=True)
        cluster = LocalCluster(Path(scratch) / "cluster", nodes=args.nodes)
        try:
            url = cluster.url(cluster.node_ids[0])
            policies = json.dumps({**POLICIES, "replication": REPLICATION}).encode()
            call(f"{url}/api/v1/streams/{STREAM}", "PUT", policies, JSON_CONTENT_TYPE)
            entry = bytes(ENTRY_SIZE)
            call(f"{url}/api/v1/streams/{STREAM}/entries", "POST", entry, OCTET_CONTENT_TYPE)
            owner = owner_of(cluster, STREAM)
            roles = _roles(cluster, owner)
            procs = {n: cluster.node(n).proc for n in cluster.node_ids}
            procs["etcd"] = cluster.etcd.proc
            pids = {n: p.pid for n, p in procs.items() if p is not None}
            replica = next(n for n, r in roles.items() if r == "replica")
            spies = {}
            if args.py_spy:
                gil = ["--gil"] if args.gil else []
                for node in (owner, replica):
                    spies[node] = subprocess.Popen(
                        [args.py_spy, "record", "--pid", str(pids[node]), "--rate",
                         str(SPY_RATE), "--format", "raw", "--nonblocking", *gil, "--duration",
                         str(int(args.seconds + WARMUP_S)), "-o", str(out / f"{node}.txt")],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )  # fmt: skip
            stored = _stored(cluster.url(replica))
            before = {n: _cpu(pid) for n, pid in pids.items()}
            load = subprocess.run(
                [sys.executable, "-m", LOAD_MODULE, cluster.url(owner), SINGLE,
                 str(args.writers), str(args.seconds), STREAM],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            used = {n: _minus(_cpu(pid), before[n]) for n, pid in pids.items()}
            adds, requests = (
                b - a for a, b in zip(stored, _stored(cluster.url(replica)), strict=True)
            )
            for spy in spies.values():
                spy.wait()
        finally:
            cluster.close()
        result = json.loads(load)
        # The CPU counters ran through the warm-up too: appends then are ~ the window's rate.
        appends = result["entries"] * (result["seconds"] + WARMUP_S) / result["seconds"]
        print(
            f"{result['entries'] / result['seconds']:.0f} appends/s, {args.writers} writers, "
            f"{result['errors']} errors; CPU ms per append:"
        )
        ms = 1000 / appends
        print(f"  {'':5} {'':14} {'total':>6} {'user':>6} {'system':>6}")
        for node, (user, system) in used.items():
            part = roles.get(node, "metadata")
            figures = f"{ms * (user + system):6.3f} {ms * user:6.3f} {ms * system:6.3f}"
            print(f"  {node:5} {part:14} {figures}")
        total = sum(user + system for user, system in used.values())
        print(f"  {'total':20} {ms * total:6.3f}")
        print(f"{replica} stored {adds / max(requests, 1):.2f} entries per request")
        for node in spies:
            print(f"\n{node} ({roles[node]}):")
            print("\n".join(_top(out / f"{node}.txt")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
