"""``python -m node shell``, run as an operator runs it (a subprocess), against a real etcd
(the metadata commands) and a real local cluster (the commands that reach the nodes): what it
prints, as text and as JSON, and its exit status (0 done, 1 failed, 2 usage)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest

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


def test_escape_keeps_text_readable_and_every_byte_visible() -> None:
    assert escape(b"hello world") == "hello world"
    assert escape(b"a\\b\nc\td\r\x00\xff") == "a\\\\b\\nc\\td\\r\\x00\\xff"
    payload = bytes(range(256))
    assert "\n" not in escape(payload) and escape(payload).isprintable()
    assert base64.b64decode(base64.b64encode(payload)) == payload
