"""Injected I/O faults (``faults``, storage/faults.py) against a real node process over HTTP.

For each fault, the node's answer: a client whose add was not made durable gets a JSON error
with a stable code, never a 201; every entry acknowledged before reads back byte for byte,
then and after a restart without the fault; the node serves on (reads always; adds too when
the fault hit the background checkpoint, which the journal covers) or, after a WAL write or
fdatasync that failed, turns read-only and not ready until a restart (as
tests/http/test_wal_failure.py shows for a real error).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from node.settings import KiB, MiB
from node.storage.entrylog import list_logs
from node.storage.logformat import log_path
from node.wire import encode_batch
from tests.harness.clients import BATCH, OCTET, http_status, read_ledger
from tests.harness.loopdev import loop_device
from tests.harness.node import CHURN_SETTINGS, DEFAULT_SETTINGS, NodeProcess

ENTRY = 4096
ACKED_FIRST = 5  # adds acknowledged before the fault is let loose
# More than two batch records' worth (max_entry_size, 5 MiB, each): half of the write holds
# the first record whole.
BIG_BATCH = 3000
FSYNC_DELAY_S = 2.0
WAIT_S = 30.0
RING = 720 * KiB  # the raw-device WAL's, as in test_crash_blockdev.py
RING_DEVICE = 4 * MiB


def _request(
    node: NodeProcess, method: str, path: str, body: bytes = b"", **headers: str
) -> tuple[int, Any]:
    """(status, JSON body) of a request; errors are answers too."""
    request = urllib.request.Request(
        f"{node.url}{path}", data=body if method != "GET" else None, method=method
    )
    for name, value in headers.items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _create_ledger(node: NodeProcess) -> int:
    status, body = _request(node, "POST", "/api/v1/ledgers")
    assert status == 201, body
    return int(body["ledgerId"])


def _add(node: NodeProcess, ledger_id: int, payload: bytes) -> tuple[int, Any]:
    return _request(node, "POST", f"/api/v1/ledgers/{ledger_id}/entries", payload, **OCTET)


def _add_batch(node: NodeProcess, ledger_id: int, payloads: list[bytes]) -> tuple[int, Any]:
    body = encode_batch(payloads)
    return _request(node, "POST", f"/api/v1/ledgers/{ledger_id}/entries", body, **BATCH)


def _payload(n: int) -> bytes:
    return n.to_bytes(4, "big") * (ENTRY // 4)


def _fault_env(*faults: str, churn: bool = False) -> dict[str, str]:
    return {**(CHURN_SETTINGS if churn else DEFAULT_SETTINGS), "NODE_FAULTS": json.dumps(faults)}


def _restart(node: NodeProcess, churn: bool = False) -> NodeProcess:
    """The node stopped (SIGTERM; a failed WAL may make it exit non-zero) and started again
    on the same data without any fault."""
    node.terminate()
    again = NodeProcess(node.data_dir, env=CHURN_SETTINGS if churn else DEFAULT_SETTINGS)
    again.start()
    return again


def _assert_holds(node: NodeProcess, ledger_id: int, acked: dict[int, bytes]) -> dict[int, bytes]:
    """Every acknowledged entry reads back byte for byte; returns all the node has."""
    found = read_ledger(node, ledger_id)
    missing = [e for e in acked if found.get(e) != acked[e]]
    assert not missing, f"acknowledged entries lost or changed: {missing[:10]}"
    return found


def _add_acked(node: NodeProcess, ledger_id: int, numbers: range, acked: dict[int, bytes]) -> None:
    """Single adds of ``_payload(n)``, each acknowledged, recorded in ``acked`` by id."""
    for n in numbers:
        status, body = _add(node, ledger_id, _payload(n))
        assert status == 201, body
        acked[body["entryId"]] = _payload(n)


def _add_until_refused(node: NodeProcess, ledger_id: int) -> tuple[dict[int, bytes], int, Any]:
    """Single adds until one is refused: (the acknowledged ones, its status and body)."""
    acked: dict[int, bytes] = {}
    for n in range(1000):
        status, body = _add(node, ledger_id, _payload(n))
        if status != 201:
            return acked, status, body
        acked[body["entryId"]] = _payload(n)
    raise AssertionError("no add was refused: the fault never fired")


def _assert_failed_wal(node: NodeProcess, ledger_id: int, status: int, body: Any) -> None:
    """A WAL that failed for good: the add was answered 500 journal_failed, adds stay
    refused, readiness and the state say so, and the node is still up."""
    assert (status, body["code"]) == (500, "journal_failed"), body
    assert body["message"]
    status, body = _add(node, ledger_id, b"after")
    assert status >= 500 and body["code"] in ("journal_failed", "read_only"), body
    assert http_status(node, "/api/v1/bookie/is_ready") == 503
    assert node.get_json("/api/v1/bookie/state")["readOnly"] is True
    assert node.alive()


@pytest.mark.parametrize(
    "fault",
    [
        f"journal.write=eio,after={ACKED_FIRST}",
        f"journal.write=short,after={ACKED_FIRST}",
        f"journal.fsync=eio,after={ACKED_FIRST}",
    ],
)
def test_a_failed_journal_write_or_fsync_refuses_the_add_and_loses_nothing(
    tmp_path: Path, fault: str
) -> None:
    """Defaults but for the fault. The add whose group write (or its fdatasync) failed gets
    500 journal_failed; the node turns read-only and not ready, serves reads, and after a
    restart holds every acknowledged entry."""
    node = NodeProcess(tmp_path / "data", env=_fault_env(fault))
    node.start()
    ledger_id = _create_ledger(node)
    acked, status, body = _add_until_refused(node, ledger_id)
    assert len(acked) >= ACKED_FIRST - 1  # (the ledger's creation was a journal write too)
    _assert_failed_wal(node, ledger_id, status, body)
    _assert_holds(node, ledger_id, acked)

    node = _restart(node)
    found = _assert_holds(node, ledger_id, acked)
    extra = sorted(set(found) - set(acked))
    if fault.startswith("journal.fsync"):
        # Its write reached the page cache and, the process going on, the file: the
        # refused add may come back (not acknowledged, so either way is right), whole.
        assert extra in ([], [len(acked)]) and all(found[e] == _payload(e) for e in extra)
    else:
        # Nothing of a failed write stays in the journal (what landed is zeroed).
        assert extra == []
    status, body = _add(node, ledger_id, b"after the restart")
    assert status == 201, body


def test_a_short_journal_write_leaves_nothing_of_a_refused_batch(tmp_path: Path) -> None:
    """A batch of several batch records whose write stops half-way (the first record whole
    on disk) then fails: 500, and after a restart none of its entries is there. Without
    the zeroing of a failed write's part, replay would bring back the batch's first
    record: a refused batch partly added."""
    node = NodeProcess(tmp_path / "data", env=_fault_env("journal.write=short,after=2"))
    node.start()
    ledger_id = _create_ledger(node)  # write 1
    status, body = _add(node, ledger_id, _payload(0))  # write 2
    assert status == 201, body
    status, body = _add_batch(node, ledger_id, [_payload(n) for n in range(1, BIG_BATCH + 1)])
    _assert_failed_wal(node, ledger_id, status, body)

    node = _restart(node)
    assert _assert_holds(node, ledger_id, {0: _payload(0)}) == {0: _payload(0)}


def test_a_torn_journal_write_then_a_crash_loses_nothing_acknowledged(tmp_path: Path) -> None:
    """Half of a group write on disk, then SIGKILL: replay cuts the torn tail; every
    acknowledged entry is there after the restart, and the node takes adds again."""
    node = NodeProcess(
        tmp_path / "data", env=_fault_env(f"journal.write=short:crash,after={ACKED_FIRST}")
    )
    node.start()
    ledger_id = _create_ledger(node)
    acked: dict[int, bytes] = {}
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        for n in range(1000):
            status, body = _add(node, ledger_id, _payload(n))
            assert status == 201, body
            acked[body["entryId"]] = _payload(n)
    assert node.proc is not None and node.proc.wait(WAIT_S) == -9
    assert len(acked) == ACKED_FIRST - 1

    node = NodeProcess(node.data_dir, env=DEFAULT_SETTINGS)
    node.start()
    assert _assert_holds(node, ledger_id, acked) == acked  # the torn add is cut
    status, body = _add(node, ledger_id, b"after the crash")
    assert status == 201 and body["entryId"] == len(acked), body


def test_a_slow_journal_fsync_delays_the_acknowledgment_not_the_reads(tmp_path: Path) -> None:
    """fdatasync takes 2 s: the add is acknowledged only after it (never before the sync),
    while reads of acknowledged entries and readiness answer at once."""
    delayed = f"journal.fsync=delay:{FSYNC_DELAY_S},after={ACKED_FIRST},times=1"
    node = NodeProcess(tmp_path / "data", env=_fault_env(delayed))
    node.start()
    ledger_id = _create_ledger(node)
    acked: dict[int, bytes] = {}
    _add_acked(node, ledger_id, range(ACKED_FIRST - 1), acked)
    answered: list[tuple[int, float]] = []

    def slow_add() -> None:
        began = time.monotonic()
        status, _body = _add(node, ledger_id, _payload(len(acked)))
        answered.append((status, time.monotonic() - began))

    adder = threading.Thread(target=slow_add)
    adder.start()
    time.sleep(FSYNC_DELAY_S / 4)  # the add is in its fsync now
    began = time.monotonic()
    assert _assert_holds(node, ledger_id, acked) == acked  # the add is not acknowledged yet
    assert http_status(node, "/api/v1/bookie/is_ready") == 200
    assert time.monotonic() - began < FSYNC_DELAY_S / 2
    assert not answered  # still waiting for its fsync
    adder.join(WAIT_S)
    [(status, took)] = answered
    assert status == 201 and took >= FSYNC_DELAY_S
    acked[len(acked)] = _payload(len(acked))
    assert _assert_holds(node, ledger_id, acked) == acked

    node = _restart(node)
    assert _assert_holds(node, ledger_id, acked) == acked


def _checkpoint_failures(node: NodeProcess) -> int:
    return len(
        re.findall(r"checkpoint failed; retrying", node.log_path.read_text(errors="replace"))
    )


def _checkpoints(node: NodeProcess) -> float:
    text = node.get_bytes("/metrics").decode()
    match = re.search(r"^storage_node_checkpoints_total (\S+)$", text, re.MULTILINE)
    assert match, "no checkpoint counter in /metrics"
    return float(match.group(1))


def _wait_for(what: str, check: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {WAIT_S} s"
        time.sleep(0.05)


def _inspect_logs(data_dir: Path) -> None:
    """Every entry log passes ``python -m node inspect entrylog`` (no partial record, no
    bad CRC left by the failed checkpoint)."""
    ledgers = data_dir / "ledgers"
    for log_id in list_logs(ledgers):
        result = subprocess.run(
            [sys.executable, "-m", "node", "inspect", "entrylog", str(log_path(ledgers, log_id))],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "fault",
    [
        "entrylog.write=eio",
        "entrylog.write=short",
        "entrylog.fsync=eio",
        "checkpoint.after_index=eio",
        "checkpoint.mark=eio",
    ],
)
def test_a_failing_checkpoint_keeps_the_node_serving(tmp_path: Path, fault: str) -> None:
    """The checkpoint's entry log write, its fsync or the lastMark write fails at every
    try (checkpoints every 100 ms): adds are still acknowledged (the journal holds them),
    every entry reads back, the node stays ready; after a restart without the fault
    (replay from the old mark) nothing is lost."""
    node = NodeProcess(tmp_path / "data", env=_fault_env(fault, churn=True))
    node.start()
    ledger_id = _create_ledger(node)
    acked: dict[int, bytes] = {}
    _add_acked(node, ledger_id, range(20), acked)
    _wait_for("failed checkpoint", lambda: _checkpoint_failures(node) >= 2)
    _add_acked(node, ledger_id, range(20, 40), acked)
    assert _assert_holds(node, ledger_id, acked) == acked
    assert http_status(node, "/api/v1/bookie/is_ready") == 200

    node = _restart(node, churn=True)
    assert _assert_holds(node, ledger_id, acked) == acked
    _inspect_logs(node.data_dir)


def test_a_slow_checkpoint_fsync_does_not_hold_the_adds(tmp_path: Path) -> None:
    """The entry log's fsync takes 2 s at every checkpoint: adds are acknowledged at the
    journal's pace meanwhile (the checkpoint works on a frozen cache, on its own thread;
    only a write cache filling up makes adds wait for it), and what they added reads back,
    then and after a restart."""
    slow = f"entrylog.fsync=delay:{FSYNC_DELAY_S}"
    node = NodeProcess(tmp_path / "data", env=_fault_env(slow, churn=True))
    node.start()
    ledger_id = _create_ledger(node)
    acked: dict[int, bytes] = {}
    _add_acked(node, ledger_id, range(20), acked)
    done = _checkpoints(node)
    began = time.monotonic()
    slowest = 0.0
    n = len(acked)
    # Adds all along a slow checkpoint: the second to complete from here ran all its
    # fsync while the adds went on.
    while _checkpoints(node) < done + 2:
        assert time.monotonic() - began < WAIT_S, "no checkpoints completed"
        small = b"%d" % n  # far from filling the write cache (adds would then wait)
        add_began = time.monotonic()
        status, body = _add(node, ledger_id, small)
        slowest = max(slowest, time.monotonic() - add_began)
        assert status == 201, body
        acked[body["entryId"]] = small
        n += 1
    assert time.monotonic() - began >= FSYNC_DELAY_S  # the checkpoint was slow...
    assert slowest < FSYNC_DELAY_S / 2  # ...and no add waited for it
    assert _assert_holds(node, ledger_id, acked) == acked

    node = _restart(node, churn=True)
    assert _assert_holds(node, ledger_id, acked) == acked


@pytest.mark.parametrize("fault", ["entrylog.write=short", "entrylog.fsync=eio"])
def test_a_checkpoint_that_failed_once_is_retried_and_the_log_stays_clean(
    tmp_path: Path, fault: str
) -> None:
    """The first checkpoint with entries fails half-way (a short write, or its fsync); the
    retry succeeds, moves the mark past the entries, and they read back from the entry log
    (the failed try's part cut off, nothing of it in the way), before and after a restart."""
    node = NodeProcess(tmp_path / "data", env=_fault_env(f"{fault},times=1", churn=True))
    node.start()
    ledger_id = _create_ledger(node)
    acked: dict[int, bytes] = {}
    _add_acked(node, ledger_id, range(40), acked)
    _wait_for("failed checkpoint", lambda: _checkpoint_failures(node) >= 1)
    done = _checkpoints(node)
    _add_acked(node, ledger_id, range(40, 41), acked)  # work for one more checkpoint
    _wait_for("checkpoint after the failure", lambda: _checkpoints(node) > done)
    assert _assert_holds(node, ledger_id, acked) == acked

    node = _restart(node, churn=True)
    assert _assert_holds(node, ledger_id, acked) == acked
    _inspect_logs(node.data_dir)


@pytest.mark.parametrize(
    "fault",
    [
        f"blockwal.write=eio,after={ACKED_FIRST}",
        f"blockwal.write=short,after={ACKED_FIRST}",
        f"blockwal.fsync=eio,after={ACKED_FIRST}",
    ],
)
def test_a_failed_ring_write_or_fsync_refuses_the_add_and_loses_nothing(
    tmp_path: Path, fault: str
) -> None:
    """The raw-device WAL (a ring on a loop device) whose block write or fdatasync fails:
    the same answers as the file journal's."""
    with loop_device(tmp_path / "wal.img", RING_DEVICE) as device:
        ring = {
            **CHURN_SETTINGS,
            "NODE_WAL_KIND": "blockdev",
            "NODE_WAL_PATH": str(device),
            "NODE_WAL_CAPACITY": str(RING),
            "NODE_FAULTS": json.dumps([fault]),
        }
        node = NodeProcess(tmp_path / "data", env=ring)
        node.start()
        ledger_id = _create_ledger(node)
        acked, status, body = _add_until_refused(node, ledger_id)
        assert len(acked) >= ACKED_FIRST - 1
        _assert_failed_wal(node, ledger_id, status, body)
        _assert_holds(node, ledger_id, acked)

        node.terminate()
        del ring["NODE_FAULTS"]
        node = NodeProcess(node.data_dir, env=ring)
        node.start()
        found = _assert_holds(node, ledger_id, acked)
        assert all(found[e] == _payload(e) for e in found)  # a refused add whole, if at all
        status, body = _add(node, ledger_id, b"after the restart")
        assert status == 201, body
