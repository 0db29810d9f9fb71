"""Running out of file descriptors, against the node as a real process limited as systemd
limits a service (1,024 open files; the hard limit too, since the node raises its soft limit
to the hard one): 1,224 unauthenticated long polls are opened while two writers add.

With the shipped max_connections the node refuses the connections past it (503
too_many_connections) and never runs out; with a bound above the limit it does run out (a
journal rotation and checkpoints fail with EMFILE) and must carry on all the same. Either
way no add answers 500, adds on new connections succeed again soon after the flood, the
node's state says what it is, and a restart finds every acknowledged entry.

``python -m tests.http.test_descriptors DIR [max_connections]`` prints the figures of
docs/api.md ("adds 10 s after the flood"), on whatever code is checked out.
"""

from __future__ import annotations

import collections
import http.client
import json
import selectors
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.settings import Settings
from tests.harness.node import DEFAULT_SETTINGS, NodeProcess

SYSTEMD_OPEN_FILES = (1024, 1024)  # DefaultLimitNOFILE's soft limit, as soft and hard
FLOOD = 1224  # long polls, 200 past the limit (as the hostile pass found it)
WRITERS = 2
ENTRY = b"x" * 1024
# Rotations during the flood: with 2 GiB journals (the default) none would come in time.
SMALL_JOURNAL = {
    "NODE_JOURNAL_MAX_SIZE": str(256 * 1024),
    "NODE_JOURNAL_PRE_ALLOC_SIZE": str(128 * 1024),
}
BEFORE_S = 1.0  # writers add alone first
FLOOD_S = 6.0  # how long the long polls are held
RESUME_BOUND_S = 5.0  # after the flood, an add on a new connection succeeds within this
PROBE_S = 5.0  # the figures' probe: adds on new connections for this long
REPORT_AFTER_S = 10.0  # ... starting this long after the flood ends


@dataclass
class Flood:
    node: NodeProcess
    ledger_id: int
    answers: dict[str, collections.Counter[str]] = field(default_factory=dict)
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    connections_seen: float | None = None  # http_connections at the flood's height
    stop: threading.Event = field(default_factory=threading.Event)
    phase: str = "before"


def _connect(node: NodeProcess) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)


def _add(conn: http.client.HTTPConnection, ledger_id: int) -> str:
    """One add: "201", or the status, code and Retry-After of a refusal."""
    conn.request(
        "POST",
        f"/api/v1/ledgers/{ledger_id}/entries",
        body=ENTRY,
        headers={"Content-Type": "application/octet-stream"},
    )
    r = conn.getresponse()
    body = r.read()
    if r.status == 201:
        return "201"
    return f"{r.status} {json.loads(body)['code']} Retry-After={r.getheader('Retry-After')}"


def _get(
    node: NodeProcess, path: str, conn: http.client.HTTPConnection | None = None
) -> tuple[int, bytes]:
    """On a new connection, or on ``conn`` (one opened before the flood: a new one may be
    refused during it)."""
    own = conn or _connect(node)
    try:
        own.request("GET", path)
        r = own.getresponse()
        return r.status, r.read()
    finally:
        if conn is None:
            own.close()


def _metrics(node: NodeProcess, conn: http.client.HTTPConnection | None = None) -> dict[str, float]:
    _, text = _get(node, "/metrics", conn)
    return samples(text.decode())


def samples(text: str) -> dict[str, float]:
    """The samples of a scrape by name, labels as Prometheus writes them: ``name{k="v"}``."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


def _writer(flood: Flood) -> None:
    conn = _connect(flood.node)
    while not flood.stop.is_set():
        try:
            answer = _add(conn, flood.ledger_id)
        except (OSError, http.client.HTTPException) as e:
            answer = type(e).__name__
            conn.close()
            conn = _connect(flood.node)
        flood.answers.setdefault(flood.phase, collections.Counter())[answer] += 1
    conn.close()


def _hold_long_polls(flood: Flood, monitor: http.client.HTTPConnection | None) -> None:
    """FLOOD connections, each sending a long poll (60 s) as soon as it is connected, held
    for FLOOD_S; what the node answered on them is counted (by code), then all close. With
    ``monitor`` (a connection of its own), http_connections is read before they close."""
    request = (
        f"GET /api/v1/ledgers/{flood.ledger_id}/lac?after=1000000000&timeoutMs=60000 "
        "HTTP/1.1\r\nHost: localhost\r\n\r\n"
    ).encode()
    selector = selectors.DefaultSelector()
    sockets = []
    for _ in range(FLOOD):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", flood.node.port))
        selector.register(s, selectors.EVENT_WRITE)
        sockets.append(s)
    end = time.monotonic() + FLOOD_S
    while time.monotonic() < end:
        for key, events in selector.select(0.1):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            if events & selectors.EVENT_WRITE:
                selector.modify(s, selectors.EVENT_READ)
                try:
                    s.send(request)
                except OSError:
                    selector.unregister(s)
                continue
            try:
                answer = s.recv(4096)
            except OSError:
                answer = b""
            selector.unregister(s)
            head, _, body = answer.partition(b"\r\n\r\n")
            if head.startswith(b"HTTP/1.1 503") and b"\r\nRetry-After: " in head:
                flood.refused[json.loads(body)["code"]] += 1
            else:
                flood.refused[head.split(b"\r\n")[0].decode() or "closed"] += 1
    if monitor is not None:
        status, _ = _get(flood.node, "/metrics", monitor)  # a node out of descriptors: 500
        if status == 200:
            metrics = _metrics(flood.node, monitor)
            flood.connections_seen = metrics["storage_node_http_connections"]
    for s in sockets:
        s.close()


@pytest.fixture
def nodes() -> Iterator[list[NodeProcess]]:
    started: list[NodeProcess] = []
    yield started
    for node in started:
        node.kill()
        NodeProcess.started.remove(node)


def _start(data_dir: Path, nodes: list[NodeProcess], **settings: str) -> NodeProcess:
    env = {**DEFAULT_SETTINGS, **SMALL_JOURNAL, **settings}
    node = NodeProcess(data_dir, env=env, open_files=SYSTEMD_OPEN_FILES)
    nodes.append(node)
    node.start()
    return node


def _flood(node: NodeProcess, monitored: bool = True) -> Flood:
    """Writers add on their own connections before and during the flood, until its
    connections are closed. ``monitored``: a scrape of /metrics during the flood (one that
    needs descriptors, which a node that ran out of them has not)."""
    conn = _connect(node)
    conn.request(
        "POST", "/api/v1/ledgers", body=b"{}", headers={"Content-Type": "application/json"}
    )
    flood = Flood(node, json.loads(conn.getresponse().read())["ledgerId"])
    conn.close()
    writers = [threading.Thread(target=_writer, args=(flood,)) for _ in range(WRITERS)]
    for writer in writers:
        writer.start()
    try:
        time.sleep(BEFORE_S)
        monitor = _connect(node) if monitored else None
        if monitor is not None:
            _get(node, "/heartbeat", monitor)
        flood.phase = "during"
        _hold_long_polls(flood, monitor)
        if monitor is not None:
            monitor.close()
        flood.phase = "after"
    finally:
        flood.stop.set()
        for writer in writers:
            writer.join()
    return flood


def _resumes(flood: Flood) -> tuple[float, list[str]]:
    """How long after the flood an add on a new connection first succeeded, and what the
    ones before it answered."""
    began = time.monotonic()
    answers = []
    while time.monotonic() - began < RESUME_BOUND_S:
        conn = _connect(flood.node)
        try:
            answers.append(_add(conn, flood.ledger_id))
        except (OSError, http.client.HTTPException) as e:
            answers.append(type(e).__name__)
        finally:
            conn.close()
        if answers[-1] == "201":
            break
        time.sleep(0.05)
    return time.monotonic() - began, answers


def _acknowledged(flood: Flood) -> int:
    return sum(counter["201"] for counter in flood.answers.values())


def _check_flood(flood: Flood) -> None:
    refusals = {
        f"{phase}: {answer}": n
        for phase, counter in flood.answers.items()
        for answer, n in counter.items()
        if answer != "201"
    }
    # A refusal is at most a 503 with Retry-After (none is expected): never a 500, a reset.
    assert all(" Retry-After=1" in key for key in refusals), refusals
    during = flood.answers.get("during", collections.Counter())
    assert during["201"] > 0, "the writers added nothing during the flood"
    elapsed, answers = _resumes(flood)
    assert answers[-1] == "201", f"adds still refused {elapsed:.1f} s after the flood: {answers}"
    status, body = _get(flood.node, "/api/v1/bookie/is_ready")
    assert status == 200, body
    _, body = _get(flood.node, "/api/v1/bookie/state")
    assert json.loads(body)["availableForHighPriorityWrites"] is True
    assert _metrics(flood.node)['storage_node_state{state="writable"}'] == 1.0


def _check_restart(flood: Flood, nodes: list[NodeProcess]) -> None:
    """Every acknowledged entry is there after a restart (the writers' and the probes')."""
    node = flood.node
    assert node.terminate() == 0
    restarted = NodeProcess(node.data_dir, env=node.env, open_files=node.open_files)
    nodes.append(restarted)
    restarted.start()
    meta = restarted.get_json(f"/api/v1/ledgers/{flood.ledger_id}")
    assert meta["lac"] + 1 == meta["entries"] >= _acknowledged(flood) + 1


@pytest.mark.parametrize("journal", ["rotating", "shipped"])
def test_a_long_poll_flood_is_refused_past_max_connections_and_adds_go_on(
    tmp_path: Path, nodes: list[NodeProcess], journal: str
) -> None:
    """The shipped bound: the connections past it get 503 too_many_connections at once, the
    node's descriptors never run out, and its writers never notice. With small journals
    (rotations during the flood, where the node first failed), and with every setting as
    shipped."""
    shipped = {
        key: str(Settings.model_fields[key.removeprefix("NODE_").lower()].default)
        for key in SMALL_JOURNAL
    }
    settings = shipped if journal == "shipped" else {}
    flood = _flood(_start(tmp_path / "data", nodes, **settings))
    _check_flood(flood)
    max_connections = Settings.model_fields["max_connections"].default
    assert flood.refused["too_many_connections"] >= FLOOD - max_connections, flood.refused
    assert set(flood.refused) == {"too_many_connections"}, flood.refused  # no poll refused else
    assert flood.connections_seen is not None and flood.connections_seen <= max_connections
    metrics = _metrics(flood.node)
    assert metrics["storage_node_http_max_connections"] == max_connections
    # (and any new connection refused while the flood's were closing)
    assert (
        metrics["storage_node_http_refused_connections_total"]
        >= flood.refused["too_many_connections"]
    )
    # The long polls ended with their clients: their places are free again.
    deadline = time.monotonic() + RESUME_BOUND_S
    while metrics["storage_node_http_connections"] > 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        metrics = _metrics(flood.node)
    assert metrics["storage_node_http_connections"] == 1  # the scrape's own
    assert metrics["storage_node_lac_long_polls"] == 0
    _check_restart(flood, nodes)


def test_descriptors_that_run_out_stop_no_write_for_good(
    tmp_path: Path, nodes: list[NodeProcess]
) -> None:
    """A bound set above the limit: the process runs out of descriptors (EMFILE), and a
    journal rotation fails for it. The current journal takes the writes meanwhile and the
    rotation happens once descriptors are free again."""
    node = _start(tmp_path / "data", nodes, NODE_MAX_CONNECTIONS=str(FLOOD + 1000))
    flood = _flood(node, monitored=False)
    log = flood.node.log_path.read_text(errors="replace")
    assert "Too many open files" in log, "the descriptors did not run out"
    _check_flood(flood)
    _check_restart(flood, nodes)


def report(data_dir: Path, max_connections: int | None) -> None:
    """The figures of docs/api.md: answers to adds on new connections REPORT_AFTER_S after
    the flood, for PROBE_S, and what the writers got meanwhile."""
    extra = {} if max_connections is None else {"NODE_MAX_CONNECTIONS": str(max_connections)}
    nodes: list[NodeProcess] = []
    try:
        node = _start(data_dir, nodes, **extra)
        flood = _flood(node, monitored=max_connections is None)
        time.sleep(REPORT_AFTER_S)
        probes: collections.Counter[str] = collections.Counter()
        end = time.monotonic() + PROBE_S
        while time.monotonic() < end:
            conn = _connect(node)
            try:
                probes[_add(conn, flood.ledger_id)] += 1
            except (OSError, http.client.HTTPException) as e:
                probes[type(e).__name__] += 1
            finally:
                conn.close()
        for phase, counter in flood.answers.items():
            print(f"writers' adds, {phase} the flood: {dict(counter)}")
        print(f"flood connections answered: {dict(flood.refused)}")
        print(
            f"adds on new connections {REPORT_AFTER_S:.0f}-{REPORT_AFTER_S + PROBE_S:.0f} s "
            f"after the flood: {dict(probes)}"
        )
        for path in ("/api/v1/bookie/is_ready", "/api/v1/bookie/state"):
            print(path, *_get(node, path))
        metrics = _metrics(node)
        print({k: v for k, v in metrics.items() if k.startswith("storage_node_state")})
    finally:
        for node in nodes:
            node.kill()


if __name__ == "__main__":
    report(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
