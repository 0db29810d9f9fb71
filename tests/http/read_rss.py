"""The node's RSS peak while four clients at once (two reading a
stream from its first entry, two reading cursors and acknowledging) each read 10,000 entries
of 100 KiB (about 1 GiB), with the node as shipped, as a process of its own.

    PYTHONPATH=$PWD .venv/bin/python -m tests.http.read_rss [--entries N] [--entry-kib K]

Each reader goes on from ``X-Next-Position`` (a cursor reader acknowledges up to the entry
before it) until it has its entries, so a node that cuts its replies is measured over the
same reads as one that answers each read whole. The clients count frames as they arrive
and keep none. ``--cap-gb`` kills the node if its RSS passes that much (a node that builds
every reply whole needs about 3 GiB per reader): the figure is then "above the cap".
tests/http/test_read_hardening.py runs the same on a smaller stream.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from node.settings import KiB
from node.wire import STREAM_HEADER, encode_batch
from tests.harness.node import DEFAULT_SETTINGS, NodeProcess

MB = 1_000_000
BATCH_BYTES = 8 * 1024 * KiB  # appends go in batches of about this much
READ_LIMIT = 10_000
SAMPLE_S = 0.02
STREAM = "big"
CURSORS = ("c0", "c1")


def rss(pid: int, field_name: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field_name}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field_name}")


class RssSampler(threading.Thread):
    """The process's RSS peak: sampled, and its VmHWM (reset at the start); kills it past
    ``cap`` bytes."""

    def __init__(self, pid: int, cap: int | None = None) -> None:
        super().__init__(daemon=True)
        self.pid, self.cap = pid, cap
        self.peak, self.capped = 0, False
        self.stop = threading.Event()
        # 5: reset the peak resident set size to the present one (proc(5), clear_refs).
        Path(f"/proc/{pid}/clear_refs").write_text("5")

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            with contextlib.suppress(OSError, AssertionError):  # it may be gone
                self.peak = max(self.peak, rss(self.pid), rss(self.pid, "VmHWM"))
                if self.cap is not None and self.peak > self.cap:
                    self.capped = True
                    os.kill(self.pid, signal.SIGKILL)
                    return

    def finish(self) -> int:
        self.stop.set()
        self.join()
        with contextlib.suppress(OSError, AssertionError):
            self.peak = max(self.peak, rss(self.pid, "VmHWM"))
        return self.peak


def _call(
    node: NodeProcess, method: str, path: str, body: bytes | None = None, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=600)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def fill(node: NodeProcess, entries: int, entry_size: int) -> None:
    """The stream STREAM with ``entries`` entries of ``entry_size`` bytes, and CURSORS at its
    first entry."""
    status, _, body = _call(node, "PUT", f"/api/v1/streams/{STREAM}", b"{}")
    assert status == 201, body
    payload = bytes(range(256)) * (entry_size // 256) + bytes(entry_size % 256)
    per_batch = max(1, BATCH_BYTES // entry_size)
    added = 0
    while added < entries:
        count = min(per_batch, entries - added)
        status, _, body = _call(
            node,
            "POST",
            f"/api/v1/streams/{STREAM}/entries",
            encode_batch([payload] * count),
            **{"Content-Type": "application/x-entry-batch"},
        )
        assert status == 201, body
        added += count
        if added == count:  # the stream has a ledger now: "earliest" is its first entry
            for cursor in CURSORS:
                start = json.dumps({"start": "earliest"}).encode()
                path = f"/api/v1/streams/{STREAM}/cursors/{cursor}"
                assert _call(node, "PUT", path, start)[0] == 201


@dataclass
class Reader:
    """Reads ``entries`` entries through one kind of read; counts what it got."""

    node: NodeProcess
    cursor: str | None  # None: a stream read from the first entry
    entries: int
    got: int = 0
    replies: int = 0
    largest_reply: int = 0
    error: str | None = None
    positions: list[str] = field(default_factory=list)  # every X-Next-Position, in order
    truncated: list[bool] = field(default_factory=list)  # every reply's X-Truncated

    def run(self) -> None:
        try:
            self._read()
        except Exception as e:  # a node killed at the cap: reported, not raised here
            self.error = repr(e)

    def _read(self) -> None:
        following: str | None = None
        while self.got < self.entries:
            if self.cursor is None:
                query = f"limit={READ_LIMIT}" + (f"&from={following}" if following else "")
                path = f"/api/v1/streams/{STREAM}/entries?{query}"
            else:
                path = f"/api/v1/streams/{STREAM}/cursors/{self.cursor}/entries?limit={READ_LIMIT}"
            conn = http.client.HTTPConnection("127.0.0.1", self.node.port, timeout=600)
            try:
                conn.request("GET", path)
                response = conn.getresponse()
                assert response.status == 200, response.read()
                count, size = _count_frames(response)
                following = response.getheader("X-Next-Position")
                cut = response.getheader("X-Truncated") == "true"
            finally:
                conn.close()
            if not count:
                return
            self.got += count
            self.replies += 1
            self.largest_reply = max(self.largest_reply, size)
            assert following is not None
            self.positions.append(following)
            self.truncated.append(cut)
            if self.cursor is not None:
                ledger, entry = following.split(":")
                ack = json.dumps({"position": f"{ledger}:{int(entry) - 1}"}).encode()
                path = f"/api/v1/streams/{STREAM}/cursors/{self.cursor}/ack"
                status, _, body = _call(self.node, "POST", path, ack)
                assert status == 200, body


def _count_frames(response: http.client.HTTPResponse) -> tuple[int, int]:
    """Frames in a stream reply, read as they arrive and dropped; and the reply's size."""
    count = size = 0
    while header := response.read(STREAM_HEADER.size):
        assert len(header) == STREAM_HEADER.size, "a torn frame header"
        left = int.from_bytes(header[16:], "big")
        size += STREAM_HEADER.size + left
        while left:
            chunk = response.read(min(left, 1 << 20))
            assert chunk, "a torn payload"
            left -= len(chunk)
        count += 1
    return count, size


@dataclass
class Figure:
    at_start: int  # RSS when the reads began
    peak: int  # RSS peak during them
    capped: bool
    readers: list[Reader]


def concurrent_reads(node: NodeProcess, entries: int, cap: int | None = None) -> Figure:
    """Two stream readers and a reader per cursor at once, each for ``entries`` entries."""
    assert node.proc is not None
    readers = [Reader(node, None, entries), Reader(node, None, entries)]
    readers += [Reader(node, cursor, entries) for cursor in CURSORS]
    at_start = rss(node.proc.pid)
    sampler = RssSampler(node.proc.pid, cap)
    sampler.start()
    threads = [threading.Thread(target=reader.run) for reader in readers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return Figure(at_start, sampler.finish(), sampler.capped, readers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--entry-kib", type=int, default=100)
    parser.add_argument("--cap-gb", type=float, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="read-rss-") as scratch:
        node = NodeProcess(Path(scratch) / "node", env=DEFAULT_SETTINGS)
        node.start()
        try:
            started = time.monotonic()
            fill(node, args.entries, args.entry_kib * KiB)
            print(
                f"filled {args.entries} x {args.entry_kib} KiB "
                f"in {time.monotonic() - started:.0f} s"
            )
            cap = int(args.cap_gb * 1e9) if args.cap_gb else None
            started = time.monotonic()
            figure = concurrent_reads(node, args.entries, cap)
            took = time.monotonic() - started
        finally:
            node.kill()
    print(
        f"RSS {figure.at_start / MB:.0f} MB when the reads began, peak "
        f"{figure.peak / MB:.0f} MB{' (killed at the cap)' if figure.capped else ''}; "
        f"{took:.1f} s"
    )
    for reader in figure.readers:
        kind = f"cursor {reader.cursor}" if reader.cursor else "stream"
        print(
            f"  {kind}: {reader.got} entries in {reader.replies} replies, largest "
            f"{reader.largest_reply / MB:.1f} MB" + (f"; {reader.error}" if reader.error else "")
        )


if __name__ == "__main__":
    main()
