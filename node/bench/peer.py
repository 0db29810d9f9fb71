"""``python -m node bench http --peer redis``: the node beside Redis Streams with
``appendonly yes`` and ``appendfsync always`` (a durable append log anyone can start in a
minute), driven by the same lean load process with the same shapes, in alternating rounds.

Shapes (1 KiB entries): 4 and 8 clients each sending batches of 100 (the node: one batch
request; Redis: 100 pipelined XADDs, which its event loop fsyncs once before replying), and
16 clients each sending one entry per request. Every client has its own ledger or stream
key. The load process speaks HTTP/1.1 and RESP itself from pre-encoded requests (no client
library on either side), so that both servers pay the same small client cost on a shared
machine; it runs on uvloop when installed, as the node does.

Each round runs the node, then Redis (the next round the other way round), so drift of the
machine hits both; the report gives each round and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from node.bench.common import Phase, UsageError, markdown_table, require_positive, scratch_dir
from node.bench.server import (
    BATCH_ENTRIES,
    ENTRY_SIZE,
    READY_TIMEOUT_S,
    WARMUP_S,
    Figures,
    cpu_seconds,
    free_port,
    serving,
    short_machine_line,
)
from node.runtime import run
from node.wire import BATCH_CONTENT_TYPE, OCTET_CONTENT_TYPE, encode_batch

# (clients, entries per request) of each shape: batches from a few clients, single adds from many.
SHAPES = ((4, BATCH_ENTRIES), (8, BATCH_ENTRIES), (16, 1))
DEFAULT_ROUNDS = 3  # alternating rounds (--rounds)
REDIS_SERVER = "redis-server"
STREAM_KEY = "bench-{}"  # one stream per client, as one ledger per client on the node

Exchange = Callable[[], Awaitable[bool]]  # one request and its reply; True when it succeeded


# --- the load process ------------------------------------------------------------------------


def _http_request(host: str, port: int, ledger: int, entries: int) -> bytes:
    if entries == 1:
        body, content_type = bytes(ENTRY_SIZE), OCTET_CONTENT_TYPE
    else:
        body, content_type = encode_batch([bytes(ENTRY_SIZE)] * entries), BATCH_CONTENT_TYPE
    head = (
        f"POST /api/v1/ledgers/{ledger}/entries HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _http_exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> Exchange:
    async def exchange() -> bool:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        at = head.lower().find(b"content-length:")
        if at >= 0:
            length = int(head[at + 15 : head.index(b"\r\n", at)])
            if length:
                await reader.readexactly(length)
        return status < 300

    return exchange


def _resp_command(*args: bytes) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


def _redis_exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: str, entries: int
) -> Exchange:
    xadd = _resp_command(b"XADD", key.encode(), b"*", b"d", bytes(ENTRY_SIZE))
    request = xadd * entries

    async def exchange() -> bool:
        writer.write(request)
        ok = True
        for _ in range(entries):
            line = await reader.readline()
            if line[:1] == b"$":  # the new entry's id, a bulk string
                await reader.readexactly(int(line[1:]) + 2)
            else:
                ok = False  # "-ERR ...": an error line
        return ok

    return exchange


async def _load(
    target: str, port: int, clients: int, entries: int, seconds: float, keys: list[int]
) -> dict[str, Any]:
    host = "127.0.0.1"
    latencies: list[float] = []
    counts = {"requests": 0, "entries": 0, "errors": 0}
    phase = Phase()
    clock = time.perf_counter

    async def client(n: int) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        if target == "node":
            exchange = _http_exchange(reader, writer, _http_request(host, port, keys[n], entries))
        else:
            exchange = _redis_exchange(reader, writer, STREAM_KEY.format(keys[n]), entries)
        try:
            while phase.running:
                started = clock()
                ok = await exchange()
                if phase.recording:
                    if ok:
                        counts["requests"] += 1
                        counts["entries"] += entries
                        latencies.append(clock() - started)
                    else:
                        counts["errors"] += 1
        finally:
            writer.close()

    tasks = [asyncio.create_task(client(n)) for n in range(clients)]
    await asyncio.sleep(WARMUP_S)
    elapsed = await phase.record(seconds)
    phase.running = False
    await asyncio.gather(*tasks)
    return {**counts, "seconds": elapsed, "latencies": latencies}


def load_main(argv: list[str]) -> None:
    target, port, clients, entries, seconds, keys = argv
    result = run(
        _load(
            target,
            int(port),
            int(clients),
            int(entries),
            float(seconds),
            [int(k) for k in keys.split(",")],
        )
    )
    json.dump(result, sys.stdout)


# --- Redis -----------------------------------------------------------------------------------


class Redis:
    """redis-server on a free loopback port with its AOF fsynced before every reply."""

    def __init__(self, data_dir: Path) -> None:
        binary = shutil.which(REDIS_SERVER)
        if binary is None:
            raise UsageError(
                f"{REDIS_SERVER} is not installed (Debian: apt-get install redis-server; "
                "`make tools` does it)"
            )
        data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(data_dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1) as s,
            ):
                s.sendall(_resp_command(b"PING"))
                if s.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        self.proc.kill()
        raise SystemExit("bench: redis-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


@contextlib.contextmanager
def redis(data_dir: Path) -> Iterator[Redis]:
    server = Redis(data_dir)
    try:
        yield server
    finally:
        server.stop()


# --- the rounds ------------------------------------------------------------------------------


def _round(
    target: str, pid: int, port: int, clients: int, entries: int, seconds: float, keys: list[int]
) -> Figures:
    cpu_before = cpu_seconds(pid)
    out = subprocess.run(
        [sys.executable, "-m", __name__, target, str(port), str(clients), str(entries),
         str(seconds), ",".join(map(str, keys))],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    cpu = cpu_seconds(pid) - cpu_before
    result = json.loads(out)
    shape = f"{clients} x {'batch ' + str(entries) if entries > 1 else 'single'}"
    return Figures(
        f"{target} {shape}",
        result["requests"],
        result["entries"],
        result["seconds"],
        result["latencies"],
        cpu * result["seconds"] / (result["seconds"] + WARMUP_S),
    )


def main(args: argparse.Namespace) -> int:
    seconds = args.seconds
    rounds = DEFAULT_ROUNDS if args.rounds is None else args.rounds
    require_positive(rounds=rounds)
    with scratch_dir(args.dir, "node-bench-peer-") as scratch:
        print(
            f"## node bench http --peer redis: {rounds} alternating rounds of {seconds} s, "
            "1 KiB entries"
        )
        print(short_machine_line(scratch))
        rows: list[Figures] = []
        medians: list[tuple[str, float, float]] = []
        with serving(scratch / "node") as node, redis(scratch / "redis") as peer:
            servers = {"node": (node.proc.pid, node.port), "redis": (peer.proc.pid, peer.port)}
            for clients, entries in SHAPES:
                rates: dict[str, list[float]] = {"node": [], "redis": []}
                for n in range(rounds):
                    keys = {
                        "node": node.ledgers(clients),
                        "redis": list(range(len(rows) * 100, len(rows) * 100 + clients)),
                    }
                    for target in ("node", "redis") if n % 2 == 0 else ("redis", "node"):
                        pid, port = servers[target]
                        figures = _round(target, pid, port, clients, entries, seconds, keys[target])
                        rows.append(figures)
                        rates[target].append(figures.entries_per_s)
                shape = rows[-1].name.split(" ", 1)[1]
                medians.append(
                    (shape, statistics.median(rates["node"]), statistics.median(rates["redis"]))
                )
        header = ("run", "requests/s", "entries/s", "MB/s", "p50 ms", "p99 ms", "server cores")
        print("\n".join(markdown_table(header, [(*f.cells(), f.cores) for f in rows])))
        print()
        summary = [
            (shape, f"{node_eps:,.0f}", f"{redis_eps:,.0f}", f"{node_eps / redis_eps:.2f}")
            for shape, node_eps, redis_eps in medians
        ]
        shape_header = ("shape (median entries/s)", "node", "redis", "node / redis")
        print("\n".join(markdown_table(shape_header, summary)))
    return 0


if __name__ == "__main__":
    load_main(sys.argv[1:])
