"""Hostile and careless clients against the node as a real process, on raw sockets: bodies
that stall, heads that trickle, idle connections, huge declared sizes, batches of a million
empty entries, clients that hang up mid-body. The node's memory stays bounded, every such
connection is closed by the server, and the node keeps answering everyone else."""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.settings import MiB, Settings
from node.wire import BATCH_HEADER, encode_batch
from tests.harness.node import DEFAULT_SETTINGS, NodeProcess

MB = 1_000_000
STALLED_CONNECTIONS = 40  # the attack as found: 40 x (declare 60 MiB, send 16 MiB, stop)
STALLED_DECLARED = 60 * MiB
STALLED_SENT = 16 * MiB
# With default settings the node's RSS stays under this while 40 bodies stall: admitted
# bodies are bounded by max_request_bytes_in_flight (128 MiB) and the rest are not read.
STALLED_RSS_BOUND = 300 * MB
SEND_WINDOW_S = 20.0  # how long the attackers push before they stop
ADD_INTERVAL_S = 0.1  # an honest client adds one entry this often during the attack
ADD_DEADLINE_S = 1.0  # ... and each add answers within this
SHORT_TIMEOUT_S = 1.5  # body, header and keep-alive timeouts of the tests' nodes
CLOSE_SLACK_S = 5.0  # a connection is closed within its timeout plus this
HEARTBEAT_BOUND_S = 0.1  # bound on /heartbeat during a huge batch
HUGE_BATCH_FRAMES = 1_000_000  # empty frames: 4 MB of body, a million entries
RSS_SAMPLE_S = 0.05

NodeFactory = Callable[..., NodeProcess]


@pytest.fixture
def start_node(tmp_path: Path) -> Iterator[NodeFactory]:
    """Nodes with the shipped defaults (short timeouts where a test waits them out)."""
    nodes: list[NodeProcess] = []

    def start(**settings: object) -> NodeProcess:
        env = {**DEFAULT_SETTINGS, **{f"NODE_{k.upper()}": str(v) for k, v in settings.items()}}
        node = NodeProcess(tmp_path / f"node{len(nodes)}", env=env)
        nodes.append(node)
        node.start()
        return node

    yield start
    for node in nodes:
        node.kill()
        NodeProcess.started.remove(node)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class _RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(RSS_SAMPLE_S):
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, _rss(self.pid))


def _connect(node: NodeProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", node.port), timeout=10)


def _head(method: str, path: str, length: int, content_type: str) -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Read (and drop) what the server sends until it closes; False if it never does."""
    deadline = time.monotonic() + within_s
    sock.setblocking(False)
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            continue
        try:
            if not sock.recv(1 << 20):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except BlockingIOError:
            continue
    return False


def _reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP reply with a Content-Length body, read from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a reply: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _create_ledger(node: NodeProcess) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=10)
    conn.request("POST", "/api/v1/ledgers")
    ledger_id = int(json.loads(conn.getresponse().read())["ledgerId"])
    conn.close()
    return ledger_id


def _metric(node: NodeProcess, name: str, **labels: str) -> float:
    text = node.get_bytes("/metrics").decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def _push(socks: list[socket.socket], data: bytes, window_s: float) -> list[int]:
    """Send ``data`` on every socket, as far as the server reads it within the window."""
    sent = [0] * len(socks)
    for sock in socks:
        sock.setblocking(False)
    deadline = time.monotonic() + window_s
    while (left := deadline - time.monotonic()) > 0:
        pending = [s for i, s in enumerate(socks) if sent[i] < len(data)]
        if not pending:
            break
        _, writable, _ = select.select([], pending, [], min(left, 0.5))
        for sock in writable:
            i = socks.index(sock)
            try:
                sent[i] += sock.send(data[sent[i] : sent[i] + (1 << 20)])
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:  # refused and closed: this attacker is done
                sent[i] = len(data)
    return sent


class _Adder(threading.Thread):
    """An honest client: one small add every ADD_INTERVAL_S; records each latency."""

    def __init__(self, node: NodeProcess, ledger_id: int) -> None:
        super().__init__(daemon=True)
        self.node, self.ledger_id = node, ledger_id
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(ADD_INTERVAL_S):
            started = time.monotonic()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.node.port, timeout=5)
                conn.request(
                    "POST",
                    f"/api/v1/ledgers/{self.ledger_id}/entries",
                    body=b"honest",
                    headers={"Content-Type": "application/octet-stream"},
                )
                response = conn.getresponse()
                response.read()
                conn.close()
                if response.status != 201:
                    self.failures.append(f"status {response.status}")
            except OSError as e:
                self.failures.append(repr(e))
            self.latencies.append(time.monotonic() - started)


def test_stalled_bodies_keep_memory_bounded_and_are_closed(start_node: NodeFactory) -> None:
    node = start_node(body_read_timeout_s=SHORT_TIMEOUT_S)
    assert node.proc is not None
    ledger_id = _create_ledger(node)
    at_start = _rss(node.proc.pid)
    sampler = _RssSampler(node.proc.pid)
    sampler.start()
    adder = _Adder(node, ledger_id)
    adder.start()
    path = f"/api/v1/ledgers/{ledger_id}/entries"
    socks = [_connect(node) for _ in range(STALLED_CONNECTIONS)]
    for sock in socks:
        sock.sendall(_head("POST", path, STALLED_DECLARED, "application/x-entry-batch"))
    try:
        _push(socks, bytes(STALLED_SENT), SEND_WINDOW_S)
        closed = [_closed_by_server(s, SHORT_TIMEOUT_S + CLOSE_SLACK_S) for s in socks]
    finally:
        adder.stop.set()
        adder.join()
        sampler.stop.set()
        sampler.join()
        for sock in socks:
            sock.close()
    print(
        f"RSS {at_start / MB:.0f} MB at start, peak {sampler.peak / MB:.0f} MB; "
        f"{len(adder.latencies)} adds, slowest {max(adder.latencies):.3f} s"
    )
    assert sampler.peak < STALLED_RSS_BOUND, f"RSS peaked at {sampler.peak / MB:.0f} MB"
    assert all(closed), f"{closed.count(False)} stalled connections still open"
    assert not adder.failures, adder.failures[:5]
    assert adder.latencies and max(adder.latencies) < ADD_DEADLINE_S, max(adder.latencies)
    assert node.get_json(f"/api/v1/ledgers/{ledger_id}")["entries"] == len(adder.latencies)


def test_budget_full_answers_503_with_retry_after(start_node: NodeFactory) -> None:
    """Two stalled bodies hold the budget: a third big one waits briefly and is refused;
    a small add fits in what is left and is served."""
    node = start_node(
        max_request_size=MiB,
        max_request_bytes_in_flight=2 * MiB + 64 * 1024,
        body_read_timeout_s=30,
    )
    ledger_id = _create_ledger(node)
    path = f"/api/v1/ledgers/{ledger_id}/entries"
    holders = [_connect(node) for _ in range(2)]
    for sock in holders:
        sock.sendall(_head("POST", path, MiB, "application/octet-stream") + bytes(1000))
    time.sleep(0.3)  # both admitted
    with _connect(node) as third:
        started = time.monotonic()
        third.sendall(_head("POST", path, MiB, "application/octet-stream"))
        status, headers, body = _reply(third)
        assert status == 503 and headers["retry-after"].isdigit()
        assert json.loads(body)["code"] == "overloaded"
        assert time.monotonic() - started < CLOSE_SLACK_S
    with _connect(node) as small:
        small.sendall(_head("POST", path, 5, "application/octet-stream") + b"small")
        assert _reply(small)[0] == 201
    for sock in holders:  # the holders finish: their bodies are served
        sock.sendall(bytes(MiB - 1000))
        assert _reply(sock)[0] == 201
        sock.close()
    assert node.get_json(f"/api/v1/ledgers/{ledger_id}")["entries"] == 3


def test_declared_size_above_the_limit_is_refused_before_the_body(
    start_node: NodeFactory,
) -> None:
    node = start_node()
    ledger_id = _create_ledger(node)
    path = f"/api/v1/ledgers/{ledger_id}/entries"
    limit = Settings.model_fields["max_request_size"].default
    with _connect(node) as sock:
        sock.sendall(_head("POST", path, limit + 1, "application/x-entry-batch"))
        status, _, body = _reply(sock)  # no byte of the body sent
    assert status == 413 and json.loads(body)["code"] == "request_too_large"


def test_chunked_bodies_are_bounded_as_they_arrive(start_node: NodeFactory) -> None:
    """Without a declared length the budget and the limit are applied as chunks arrive."""
    node = start_node(max_request_size=MiB)
    ledger_id = _create_ledger(node)
    head = (
        f"POST /api/v1/ledgers/{ledger_id}/entries HTTP/1.1\r\nHost: localhost\r\n"
        "Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunk = bytes(256 * 1024)
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    with _connect(node) as sock:
        sock.sendall(head + framed + b"0\r\n\r\n")
        assert _reply(sock)[0] == 201
    with _connect(node) as sock:
        sock.sendall(head)
        with contextlib.suppress(OSError):  # refused mid-body: the rest may meet a reset
            for _ in range(5):  # 1.25 MiB in all
                sock.sendall(framed)
        status, _, body = _reply(sock)
    assert status == 413 and json.loads(body)["code"] == "request_too_large"
    assert node.get_json(f"/api/v1/ledgers/{ledger_id}")["entries"] == 1


def test_slowloris_head_and_idle_connections_are_closed(start_node: NodeFactory) -> None:
    node = start_node(header_timeout_s=SHORT_TIMEOUT_S, keepalive_timeout_s=SHORT_TIMEOUT_S)
    trickler = _connect(node)
    trickler.sendall(b"GET /heartbeat HTTP/1.1\r\nHost: localhost\r\n")
    started = time.monotonic()
    closed = False
    # One header byte at a time: the head never ends, yet bytes keep coming.
    while not closed and time.monotonic() - started < SHORT_TIMEOUT_S + CLOSE_SLACK_S:
        try:
            trickler.sendall(b"X")
        except OSError:
            closed = True
        closed = closed or _closed_by_server(trickler, 0.2)
    assert closed, "a head trickled byte by byte kept its connection"
    trickler.close()

    with _connect(node) as silent:  # connects and never sends a byte
        assert _closed_by_server(silent, SHORT_TIMEOUT_S + CLOSE_SLACK_S)
    with _connect(node) as idle:  # one request, then idle on keep-alive
        idle.sendall(b"GET /heartbeat HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert _reply(idle)[0] == 200
        assert _closed_by_server(idle, SHORT_TIMEOUT_S + CLOSE_SLACK_S)


def test_slow_but_steady_clients_are_served(start_node: NodeFactory) -> None:
    """The timeouts bound silence, not duration: a long poll and a body sent a byte at a
    time (each within the timeouts, all of it well past them) are served, and their
    connections stay open for the next request."""
    node = start_node(
        header_timeout_s=SHORT_TIMEOUT_S,
        body_read_timeout_s=SHORT_TIMEOUT_S,
        keepalive_timeout_s=SHORT_TIMEOUT_S,
    )
    ledger_id = _create_ledger(node)
    poll_ms = int(2 * SHORT_TIMEOUT_S * 1000)
    with _connect(node) as sock:
        sock.sendall(
            f"GET /api/v1/ledgers/{ledger_id}/lac?after=0&timeoutMs={poll_ms} HTTP/1.1\r\n"
            "Host: localhost\r\n\r\n".encode()
        )
        status, _, body = _reply(sock)
        assert status == 200 and json.loads(body)["lac"] == -1
        path = f"/api/v1/ledgers/{ledger_id}/entries"
        payload = b"steady"
        sock.sendall(_head("POST", path, len(payload), "application/octet-stream"))
        for byte in payload:
            time.sleep(SHORT_TIMEOUT_S / 3)
            sock.sendall(bytes([byte]))
        status, _, body = _reply(sock)
        assert status == 201 and json.loads(body)["entryId"] == 0
        sock.sendall(_head("POST", path, 1, "application/octet-stream") + b"x")
        assert _reply(sock)[0] == 201
    assert node.get_bytes(f"/api/v1/ledgers/{ledger_id}/entries/0") == payload


class _HeartbeatProbe(threading.Thread):
    """Times /heartbeat back to back on one keep-alive connection."""

    def __init__(self, node: NodeProcess) -> None:
        super().__init__(daemon=True)
        self.node = node
        self.latencies: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.node.port, timeout=30)
        while not self.stop.is_set():
            started = time.monotonic()
            conn.request("GET", "/heartbeat")
            conn.getresponse().read()
            self.latencies.append(time.monotonic() - started)
            time.sleep(0.005)
        conn.close()


def _post_batch(node: NodeProcess, path: str, body: bytes) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=60)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/x-entry-batch"})
    response = conn.getresponse()
    reply = json.loads(response.read())
    conn.close()
    return response.status, reply


def test_huge_batches_do_not_stall_the_node(start_node: NodeFactory) -> None:
    """A million empty frames is refused; the largest batch allowed is served; /heartbeat
    answers within 100 ms all the while, and replies name the first and last id only."""
    node = start_node()
    ledger_id = _create_ledger(node)
    path = f"/api/v1/ledgers/{ledger_id}/entries"
    largest = Settings.model_fields["max_entries_per_batch"].default
    probe = _HeartbeatProbe(node)
    probe.start()
    time.sleep(0.2)
    try:
        status, reply = _post_batch(node, path, BATCH_HEADER.pack(0) * HUGE_BATCH_FRAMES)
        assert status == 413 and reply["code"] == "too_many_entries", reply
        for round_ in range(3):
            status, reply = _post_batch(node, path, encode_batch([b""] * largest))
            assert status == 201, reply
            assert reply["firstEntryId"] == round_ * largest
            assert reply["lastEntryId"] == (round_ + 1) * largest - 1
            assert "entryIds" not in reply
        time.sleep(0.2)
    finally:
        probe.stop.set()
        probe.join()
    worst = max(probe.latencies)
    print(f"{len(probe.latencies)} heartbeats, slowest {worst * 1000:.1f} ms")
    assert worst < HEARTBEAT_BOUND_S, f"/heartbeat took {worst * 1000:.0f} ms"


def test_client_hanging_up_mid_body_is_a_client_abort(start_node: NodeFactory) -> None:
    node = start_node()
    ledger_id = _create_ledger(node)
    path = f"/api/v1/ledgers/{ledger_id}/entries"
    route = "/api/v1/ledgers/{lid}/entries"
    name = "storage_node_http_request_duration_seconds_count"
    with _connect(node) as sock:
        sock.sendall(_head("POST", path, 1000, "application/octet-stream") + bytes(500))
        time.sleep(0.2)
    deadline = time.monotonic() + CLOSE_SLACK_S
    while _metric(node, name, route=route, status="499") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(node, name, route=route, status="499") == 1
    assert _metric(node, name, status="500") == 0
    log = node.log()
    assert "Traceback" not in log and "ERROR" not in log, log
    assert "client hung up" in log
