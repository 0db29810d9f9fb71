"""``python -m node shell``, run as an operator runs it (a subprocess), against a real etcd
(the metadata commands) and a real local cluster (the commands that reach the nodes): what it
prints, as text and as JSON, and its exit status (0 done, 1 failed, 2 usage)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from typing import Any

import pytest

from node.client import Client
from node.client.metadata.etcd import EtcdStore
from node.client.model import (
    LedgerMetadata,
    LedgerState,
    NodeInfo,
    NodeState,
    Segment,
    cookie_key,
    encode,
    ledger_key,
    node_key,
)
from node.client.shell import escape
from node.devcluster import DEFAULT_NODES
from node.localcluster import LocalCluster, ProcessExited
from tests.harness.cluster import cluster_env
from tests.harness.etcd import EtcdServer
from tests.harness.hostdisk import REPO
from tests.harness.ports import free_port

RUN_TIMEOUT_S = 120  # a shell command; only stops a hang
LEASE_TTL_S = 60  # the registrations the tests write: outlive the test
BASE = 2**62  # fleet-wide ledger ids start here


def shell(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m node shell ARGV`` from the repository, to its end."""
    environment = {k: v for k, v in os.environ.items() if k != "NODE_METADATA_URL"}
    return subprocess.run(
        [sys.executable, "-m", "node", "shell", *argv],
        env={**environment, **(env or {})},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


def shell_json(*argv: str) -> Any:
    result = shell(*argv, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def _ledger(lid: int, state: LedgerState = LedgerState.OPEN, **fields: Any) -> LedgerMetadata:
    return LedgerMetadata(
        ledger_id=lid,
        ensemble_size=3,
        write_quorum=3,
        ack_quorum=2,
        segments=(Segment(0, ("n0", "n1", "n2")), Segment(5, ("n0", "n3", "n2"))),
        state=state,
        ctime_ms=1_764_170_000_000,
        creator="test",
        properties={"purpose": "shell test"},
        **fields,
    )


@pytest.fixture
def metadata(etcd: EtcdServer) -> Any:
    """A prefix of this test's own on the session's etcd, holding two registered nodes, a
    node known only by its cookie, and two ledgers (one OPEN, one CLOSED)."""
    url = etcd.url(f"shell-{uuid.uuid4().hex[:12]}")

    async def fill() -> None:
        store = EtcdStore(url)
        try:
            lease = await store.grant_lease(LEASE_TTL_S)
            for node_id, zone, state in (
                ("n0", "a", NodeState.WRITABLE),
                ("n1", "b", NodeState.READONLY),
            ):
                info = NodeInfo(
                    node_id, f"http://127.0.0.1:{free_port()}", zone, state, f"i-{node_id}"
                )
                await store.put(node_key(node_id), info.encode(), lease=lease)
            for node_id in ("n0", "n1", "n2"):
                cookie = {
                    "layout": 1,
                    "clusterId": "c",
                    "nodeId": node_id,
                    "instanceId": f"i-{node_id}",
                }
                await store.create(cookie_key(node_id), json.dumps(cookie).encode())
            await store.create(ledger_key(BASE + 1), encode(_ledger(BASE + 1)))
            closed = _ledger(BASE + 2, LedgerState.CLOSED, last_entry_id=9, length=90, closed_ms=1)
            await store.create(ledger_key(BASE + 2), encode(closed))
        finally:
            await store.close()

    asyncio.run(fill())
    return url


def test_listnodes_shows_registered_nodes_and_those_known_only_by_their_cookie(
    metadata: str,
) -> None:
    nodes = {n["id"]: n for n in shell_json("listnodes", "--metadata-url", metadata)["nodes"]}
    assert set(nodes) == {"n0", "n1", "n2"}
    assert nodes["n0"]["registered"] and nodes["n0"]["zone"] == "a"
    assert nodes["n0"]["state"] == "writable" and nodes["n0"]["instance"] == "i-n0"
    assert nodes["n1"]["state"] == "readonly"
    assert nodes["n2"] == {
        "id": "n2",
        "url": None,
        "zone": None,
        "state": None,
        "instance": "i-n2",
        "registered": False,
    }
    text = shell("listnodes", env={"NODE_METADATA_URL": metadata})  # the URL from the environment
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split() == ["id", "url", "zone", "state", "instance", "registered"]
    assert lines[1].split()[0::2] == ["n0", "a", "i-n0"] and lines[1].split()[-1] == "yes"
    assert lines[3].split() == ["n2", "-", "-", "-", "i-n2", "no"]


def test_listledgers_and_ledgermetadata(metadata: str) -> None:
    ledgers = shell_json("--metadata-url", metadata, "listledgers")["ledgers"]  # --json after
    assert [m["ledgerId"] for m in ledgers] == [BASE + 1, BASE + 2]  # in id order
    assert [m["state"] for m in ledgers] == ["OPEN", "CLOSED"]
    text = shell("listledgers", "--metadata-url", metadata).stdout.splitlines()
    assert text[0].split()[:2] == ["ledger", "state"]
    assert text[1].split() == [str(BASE + 1), "OPEN", "3/3/2", "-", "-", "2", "n0,n3,n2"]
    assert text[2].split() == [str(BASE + 2), "CLOSED", "3/3/2", "9", "90", "2", "n0,n3,n2"]

    meta = shell_json("ledgermetadata", str(BASE + 2), "--metadata-url", metadata)
    assert meta == {
        **_ledger(BASE + 2, LedgerState.CLOSED, last_entry_id=9, length=90, closed_ms=1).to_json(),
        "revision": meta["revision"],
    }
    assert meta["revision"] > 0
    printed = shell("ledgermetadata", str(BASE + 2), "--metadata-url", metadata)
    assert json.loads(printed.stdout) == meta  # the text form is the same JSON, indented


def test_a_missing_ledger_fails_with_its_code(metadata: str) -> None:
    for command in ("ledgermetadata", "readledger", "recover", "deleteledger"):
        result = shell(command, str(BASE + 99), "--json", "--metadata-url", metadata)
        assert result.returncode == 1, (command, result.stdout, result.stderr)
        assert json.loads(result.stdout) == {
            "code": "ledger_not_found",
            "message": f"ledger {BASE + 99}: no such ledger",
        }
        text = shell(command, str(BASE + 99), "--metadata-url", metadata)
        assert text.returncode == 1 and "no such ledger" in text.stderr and not text.stdout


def test_readd_refuses_a_registered_node(metadata: str) -> None:
    result = shell("readd", "n0", "--json", "--metadata-url", metadata)
    assert result.returncode == 1
    assert json.loads(result.stdout)["code"] == "node_registered"
    # Nothing was done: the cookie is still there.
    assert {n["id"] for n in shell_json("listnodes", "--metadata-url", metadata)["nodes"]} == {
        "n0",
        "n1",
        "n2",
    }


def test_recommission_takes_the_decommissioning_mark_away(metadata: str) -> None:
    """A decommission started by mistake: the auditor counts the node as leaving until
    ``recommission`` removes the mark; then it no longer does, and a second one says so."""
    url = ("--metadata-url", metadata)
    started = shell_json("decommission", "n0", *url)
    assert started["node"] == "n0" and started["stillNeeded"], started
    report = shell_json("auditor", "--once", *url)
    assert report["decommissioningNodes"] == ["n0"], report
    assert report["underReplicatedLedgers"] == len(started["stillNeeded"]), report
    assert shell_json("recommission", "n0", *url) == {"node": "n0", "removed": True}
    # n0 is registered and no longer leaving: the next audit drops its markers.
    report = shell_json("auditor", "--once", *url)
    assert report["decommissioningNodes"] == [] and report["underReplicatedLedgers"] == 0
    assert shell_json("recommission", "n0", *url) == {"node": "n0", "removed": False}
    text = shell("recommission", "n0", *url)
    assert text.returncode == 0 and text.stdout == "node n0: was not decommissioning\n"


def test_usage_errors_exit_2() -> None:
    no_url = shell("listnodes", "--json")
    assert no_url.returncode == 2
    assert json.loads(no_url.stdout)["code"] == "usage"
    assert "NODE_METADATA_URL" in json.loads(no_url.stdout)["message"]
    bad_url = shell("listnodes", "--metadata-url", "http://127.0.0.1:1/x")
    assert bad_url.returncode == 2 and "etcd://" in bad_url.stderr
    for argv in (
        ["readledger", "x"],
        ["readledger", "1", "--from", "-1"],
        ["ledgermetadata"],
        ["nosuchcommand"],
        [],
    ):
        result = shell(*argv, "--metadata-url", "etcd://127.0.0.1:1/x")
        assert result.returncode == 2, (argv, result.stderr)
        assert "usage:" in result.stderr


def test_an_unreachable_store_fails_with_exit_1() -> None:
    url = f"etcd://127.0.0.1:{free_port()}/nobody"
    result = shell("listledgers", "--json", "--metadata-url", url)
    assert result.returncode == 1
    assert json.loads(result.stdout)["code"] == "store_unavailable"


def test_the_cli_loads_the_shell_only_for_the_shell() -> None:
    """The shell's parser lives with the client: parsing any other command (``serve``) loads
    nothing of node.client."""
    code = (
        "import sys, node.cli; node.cli.build_parser().parse_args(['serve']); "
        "print(sorted(m for m in sys.modules if m.startswith('node.client')))"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert found.stdout.strip() == "[]"


def test_escape_keeps_text_readable_and_every_byte_visible() -> None:
    assert escape(b"hello world") == "hello world"
    assert escape(b"a\\b\nc\td\r\x00\xff") == "a\\\\b\\nc\\td\\r\\x00\\xff"
    payload = bytes(range(256))
    assert "\n" not in escape(payload) and escape(payload).isprintable()
    assert base64.b64decode(base64.b64encode(payload)) == payload


# --- against a real cluster: etcd and three node processes --------------------------------------

WRITER = """
import asyncio, sys, time
from node.client import Client

async def main():
    async with Client(sys.argv[1]) as client:
        ledger = await client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        for i in range(int(sys.argv[2])):
            await ledger.add(b"entry %d" % i)
        print(ledger.id, flush=True)
        time.sleep(3600)  # killed here: the ledger stays OPEN, as after a writer's crash

asyncio.run(main())
"""
WRITER_TIMEOUT_S = 60


def crashed_writer(metadata_url: str, entries: int) -> int:
    """A writer process that adds ``entries`` entries to a new ledger and is SIGKILLed before
    it closes it: the ledger's id."""
    with subprocess.Popen(
        [sys.executable, "-c", WRITER, metadata_url, str(entries)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            line = proc.stdout.readline()
            assert line.strip().isdigit(), (line, "" if proc.poll() is None else proc.stderr.read())
            return int(line)
        finally:
            proc.kill()
            proc.wait(WRITER_TIMEOUT_S)


def closed_ledger(metadata_url: str, payloads: list[bytes]) -> int:
    """A ledger with ``payloads``, closed by its writer: its id."""

    async def write() -> int:
        async with Client(metadata_url) as client:
            ledger = await client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
            await ledger.add_batch(payloads)
            await ledger.close()
            return int(ledger.id)

    return asyncio.run(write())


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with LocalCluster(tmp_path_factory.mktemp("shell-cluster"), env=cluster_env()) as cluster:
        yield cluster


def test_readledger_prints_escaped_text_and_base64_json(local_cluster: Any) -> None:
    url = local_cluster.metadata_url
    payloads = [b"hello", b"two\nlines\tand a \\", bytes([0, 1, 0xFF]), b""]
    lid = closed_ledger(url, payloads)
    text = shell("readledger", str(lid), "--metadata-url", url)
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines() == [
        "0\thello",
        "1\ttwo\\nlines\\tand a \\\\",
        "2\t\\x00\\x01\\xff",
        "3\t",
    ]
    document = shell_json("readledger", str(lid), "--metadata-url", url)
    assert document["ledgerId"] == lid
    assert [base64.b64decode(e["payload"]) for e in document["entries"]] == payloads
    assert [e["entryId"] for e in document["entries"]] == [0, 1, 2, 3]
    part = shell_json("readledger", str(lid), "--from", "1", "--to", "2", "--metadata-url", url)
    assert [e["entryId"] for e in part["entries"]] == [1, 2]
    meta = shell_json("ledgermetadata", str(lid), "--metadata-url", url)
    assert meta["state"] == "CLOSED" and meta["lastEntryId"] == 3
    assert meta["length"] == sum(map(len, payloads))
    assert sorted(meta["segments"][0]["ensemble"]) == ["n0", "n1", "n2"]
    nodes = shell_json("listnodes", "--metadata-url", url)["nodes"]
    assert [(n["id"], n["registered"], n["state"]) for n in nodes] == [
        ("n0", True, "writable"),
        ("n1", True, "writable"),
        ("n2", True, "writable"),
    ]
    assert [n["url"] for n in nodes] == [local_cluster.url(n) for n in ("n0", "n1", "n2")]
    assert all(n["instance"] for n in nodes)


def test_recover_closes_a_crashed_writers_ledger_after_its_acknowledged_entries(
    local_cluster: Any,
) -> None:
    url = local_cluster.metadata_url
    lid = crashed_writer(url, 5)
    assert shell_json("ledgermetadata", str(lid), "--metadata-url", url)["state"] == "OPEN"
    result = shell("recover", str(lid), "--metadata-url", url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"ledger {lid}: was OPEN, now CLOSED at lastEntryId 4")
    meta = shell_json("ledgermetadata", str(lid), "--metadata-url", url)
    assert (meta["state"], meta["lastEntryId"]) == ("CLOSED", 4)
    read = shell("readledger", str(lid), "--metadata-url", url).stdout.splitlines()
    assert read == [f"{i}\tentry {i}" for i in range(5)]
    again = shell_json("recover", str(lid), "--metadata-url", url)  # a closed ledger: no-op
    assert again["before"] == "CLOSED" and again["metadata"]["lastEntryId"] == 4


def test_deleteledger_removes_the_ledger(local_cluster: Any) -> None:
    url = local_cluster.metadata_url
    lid = closed_ledger(url, [b"x"])
    assert lid in [
        m["ledgerId"] for m in shell_json("listledgers", "--metadata-url", url)["ledgers"]
    ]
    assert shell_json("deleteledger", str(lid), "--metadata-url", url) == {
        "ledgerId": lid,
        "deleted": True,
    }
    gone = shell("ledgermetadata", str(lid), "--json", "--metadata-url", url)
    assert gone.returncode == 1 and json.loads(gone.stdout)["code"] == "ledger_not_found"
    listed = shell_json("listledgers", "--metadata-url", url)["ledgers"]
    assert lid not in [m["ledgerId"] for m in listed]


READD_WAIT_S = 60  # a killed node's registration lasts its lease (registration_ttl_s)


def test_readd_lets_a_wiped_node_back_as_a_new_one(tmp_path: Any) -> None:
    """The wiped node refuses to start; readd recovers the open ledger that named it (and
    leaves the closed one alone), retires its cookie; then it starts, with a new instance."""
    with LocalCluster(tmp_path / "cluster", env=cluster_env()) as cluster:
        url = cluster.metadata_url
        closed = closed_ledger(url, [b"kept"])
        open_lid = crashed_writer(url, 3)
        before = {n["id"]: n for n in shell_json("listnodes", "--metadata-url", url)["nodes"]}
        cluster.wipe("n2")
        with pytest.raises(ProcessExited) as refused:
            cluster.start("n2")
        assert refused.value.returncode == 2 and "shell readd n2" in refused.value.log
        deadline = time.monotonic() + READD_WAIT_S
        while True:
            nodes = {n["id"]: n for n in shell_json("listnodes", "--metadata-url", url)["nodes"]}
            if not nodes["n2"]["registered"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not nodes["n2"]["registered"], nodes
        result = shell("readd", "n2", "--json", "--metadata-url", url)
        assert result.returncode == 0, result.stdout + result.stderr
        done = json.loads(result.stdout)
        assert done["node"] == "n2" and done["retiredInstance"] == before["n2"]["instance"]
        assert [m["ledgerId"] for m in done["recovered"]] == [open_lid]
        assert done["recovered"][0]["state"] == "CLOSED"
        assert done["recovered"][0]["lastEntryId"] == 2
        meta = shell_json("ledgermetadata", str(closed), "--metadata-url", url)
        assert meta["state"] == "CLOSED" and meta["lastEntryId"] == 0
        cluster.start("n2")
        after = {n["id"]: n for n in shell_json("listnodes", "--metadata-url", url)["nodes"]}
        assert after["n2"]["registered"]
        assert after["n2"]["instance"] != before["n2"]["instance"]
        read = shell("readledger", str(open_lid), "--metadata-url", url)
        assert read.stdout.splitlines() == [f"{i}\tentry {i}" for i in range(3)], read.stderr


DEVCLUSTER_READY_S = 90  # etcd and the nodes start; only stops a hang


def _devcluster(root: Any) -> tuple[subprocess.Popen[str], str]:
    """``make cluster``'s program on ``root``, up: the process and the metadata URL it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "node.devcluster", "--root", str(root)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    printed = []
    for line in proc.stdout:
        printed.append(line)
        if line.startswith("Ctrl-C"):
            break
    text = "".join(printed)
    urls = [line.split()[2] for line in printed if line.startswith("metadata store:")]
    assert urls and proc.poll() is None, text
    for node_id in ("n0", "n1", "n2"):
        assert f"node {node_id}: http://127.0.0.1:" in text, text
    assert f"export NODE_METADATA_URL={urls[0]}" in text and "-m node shell listnodes" in text
    return proc, urls[0]


def _interrupt(proc: subprocess.Popen[str]) -> int:
    """Ctrl-C: its exit status once it has stopped everything."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(DEVCLUSTER_READY_S)
    finally:
        assert proc.stdout is not None
        proc.stdout.close()


def test_make_cluster_runs_until_interrupted_and_comes_back_the_same(tmp_path: Any) -> None:
    root = tmp_path / "cluster"
    proc, url = _devcluster(root)
    try:
        first = shell_json("listnodes", "--metadata-url", url)["nodes"]
        assert [(n["id"], n["registered"]) for n in first] == [
            (f"n{i}", True) for i in range(DEFAULT_NODES)
        ]
        lid = closed_ledger(url, [b"survives a restart"])
    finally:
        assert _interrupt(proc) == 0
    node_urls = [n["url"] for n in first]
    for node_url in node_urls:  # every node stopped with it
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{node_url}/heartbeat", timeout=1)
    assert {p.name for p in root.iterdir()} >= {"etcd", "n0", "n1", "n2"}

    proc, url = _devcluster(root)  # the same directory: the same cluster
    try:
        again = shell_json("listnodes", "--metadata-url", url)["nodes"]
        assert [n["instance"] for n in again] == [n["instance"] for n in first]
        read = shell("readledger", str(lid), "--metadata-url", url)
        assert read.stdout == "0\tsurvives a restart\n", read.stderr
    finally:
        assert _interrupt(proc) == 0


def test_the_auditor_says_which_unregistered_nodes_are_not_lost_yet(metadata: str) -> None:
    """n2 has a cookie and no registration: within the delay the audit marks nothing for it,
    and its text says so, with when n2 counts as lost; with no delay it is lost at once."""
    url = ("--metadata-url", metadata)
    text = shell("auditor", "--once", *url)
    assert text.returncode == 0, text.stderr
    assert "lost: -" in text.stdout
    assert "unregistered, not counted lost yet: n2 (lost at " in text.stdout, text.stdout
    text = shell("auditor", "--once", "--lost-node-delay", "0", *url)
    assert "lost: n2;" in text.stdout and "not counted lost yet" not in text.stdout, text.stdout
