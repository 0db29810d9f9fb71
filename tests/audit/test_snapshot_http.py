"""A live node's audit snapshot read over HTTP (GET /api/v1/audit/snapshots/{id}/...): its
metadata and tables whole, its logs by byte ranges, nothing outside it, with the admin token
when one is set, under the read budget and the audit's pace."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from node.audit import job, kept
from node.http.app import build_app
from node.http.state import READ_BUDGET, STORAGE
from node.storage import logformat
from tests.audit import world as w
from tests.harness.settings import make_settings

pytestmark = pytest.mark.timeout(120)

TOKEN = "audit-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROUNDS = 200  # entries of ~1 KB: a few 64 KiB logs
PACE = 64 * 1024  # bytes/s: slow enough to measure, fast enough for a test
BUDGET_WAIT_S = 0.2
SPLIT_BYTES = 16 * 1024  # several tasks per log: ranges start mid-record, over HTTP too
FLIPPED_ENTRY = 77


def _settings(data_dir: Path, **extra: Any) -> Any:
    return make_settings(
        data_dir,
        log_size_limit=w.LOG_SIZE,
        max_entry_size=16 * 1024,
        flush_interval_ms=3_600_000,
        gc_wait_time_ms=3_600_000,
        retention_scheduler_enabled=False,
        **extra,
    )


async def _node_with_snapshot(aiohttp_client: Any, settings: Any) -> tuple[Any, str, Path]:
    """A node with entries in several logs and a snapshot: the client, the snapshot's path
    under /api/v1/..., its directory."""
    client = await aiohttp_client(build_app(settings))
    headers = AUTH if settings.admin_token else {}
    r = await client.post("/api/v1/ledgers", headers=headers)
    lid = (await r.json())["ledgerId"]
    for i in range(ROUNDS):
        r = await client.post(
            f"/api/v1/ledgers/{lid}/entries", data=w.payload(lid, i), headers=headers
        )
        assert r.status == 201, await r.text()
    await client.app[STORAGE].checkpoint()
    r = await client.post("/api/v1/audit/snapshot", headers=headers)
    assert r.status == 201, await r.text()
    taken = await r.json()
    directory = Path(taken["uri"].removeprefix("file://"))
    assert taken["url"] == f"{client.make_url('')}/api/v1/audit/snapshots/{directory.name}/"
    return client, f"/api/v1/audit/snapshots/{directory.name}", directory


def _logs(directory: Path) -> list[Path]:
    return sorted((directory / kept.LOGS_DIR).glob(f"*{logformat.SUFFIX}"))


async def _error(r: Any, status: int, code: str) -> dict[str, Any]:
    assert r.status == status, await r.text()
    body: dict[str, Any] = await r.json()
    assert body["code"] == code, body
    return body


async def test_files_whole_and_logs_by_ranges(tmp_path: Path, aiohttp_client: Any) -> None:
    client, base, directory = await _node_with_snapshot(aiohttp_client, _settings(tmp_path / "d"))
    r = await client.get(f"{base}/{kept.META_FILE}")
    assert r.status == 200
    assert await r.read() == await asyncio.to_thread((directory / kept.META_FILE).read_bytes)
    r = await client.get(f"{base}/logs.parquet")
    assert r.status == 200
    table = pq.read_table(io.BytesIO(await r.read()))
    logs = await asyncio.to_thread(_logs, directory)
    assert len(logs) >= 2 and table.num_rows == len(logs)

    log = logs[0]
    data = await asyncio.to_thread(log.read_bytes)
    size = len(data)
    url = f"{base}/logs/{log.name}"
    for header, start, end in [
        ("bytes=100-1099", 100, 1100),
        (f"bytes={size - 10}-", size - 10, size),
        ("bytes=-64", size - 64, size),
        (f"bytes=5-{size + 1000}", 5, size),  # a last byte past the end: up to the end
    ]:
        r = await client.get(url, headers={"Range": header})
        assert r.status == 206, (header, await r.text())
        assert r.headers["Content-Range"] == f"bytes {start}-{end - 1}/{size}"
        assert await r.read() == data[start:end]
    r = await client.get(url)
    assert r.status == 200 and r.headers["Accept-Ranges"] == "bytes"
    assert await r.read() == data
    r = await client.head(url, headers={"Range": "bytes=0-9"})
    assert r.status == 206 and r.headers["Content-Range"] == f"bytes 0-9/{size}"

    for bad in [f"bytes={size}-", "bytes=0-1,5-6", "items=0-1", "bytes=-", "bytes=9-3"]:
        r = await client.get(url, headers={"Range": bad})
        await _error(r, 416, "range_not_satisfiable")
        assert r.headers["Content-Range"] == f"bytes */{size}", bad


async def test_no_path_leaves_the_snapshot(tmp_path: Path, aiohttp_client: Any) -> None:
    settings = _settings(tmp_path / "d")
    client, base, _directory = await _node_with_snapshot(aiohttp_client, settings)
    secret = settings.data_dir / "secret.json"
    await asyncio.to_thread(secret.write_text, '{"secret": true}')
    prefix = "/api/v1/audit/snapshots"
    for path, status, code in [
        (f"{prefix}/../secret.json", 404, "not_found"),  # normalized away: no such route
        (f"{prefix}/..%2F..%2F/secret.json", 400, "invalid_path"),
        (f"{prefix}/.hidden/snapshot.json", 400, "invalid_path"),
        (f"{prefix}/nosuch/snapshot.json", 404, "not_found"),
        (f"{base}/..%2F..%2Fsecret.json", 404, "not_found"),  # not a snapshot's file
        (f"{base}/index", 404, "not_found"),
        (f"{base}/logs/..%2F{kept.META_FILE}", 400, "invalid_path"),
        (f"{base}/logs/0.log.map", 400, "invalid_path"),
        (f"{base}/logs/ffff.log", 404, "not_found"),
    ]:
        r = await client.get(path)
        await _error(r, status, code)


async def test_admin_token_guards_the_files(tmp_path: Path, aiohttp_client: Any) -> None:
    settings = _settings(tmp_path / "d", admin_token=TOKEN)
    client, base, _directory = await _node_with_snapshot(aiohttp_client, settings)
    await _error(await client.get(f"{base}/{kept.META_FILE}"), 401, "unauthorized")
    r = await client.get(f"{base}/{kept.META_FILE}", headers={"Authorization": "Bearer nope"})
    await _error(r, 403, "forbidden")
    r = await client.get(f"{base}/{kept.META_FILE}", headers=AUTH)
    assert r.status == 200


async def test_read_budget_and_pace(tmp_path: Path, aiohttp_client: Any) -> None:
    settings = _settings(
        tmp_path / "d", audit_serve_bytes_per_s=PACE, request_budget_wait_s=BUDGET_WAIT_S
    )
    client, base, directory = await _node_with_snapshot(aiohttp_client, settings)
    logs = await asyncio.to_thread(_logs, directory)
    contents = [await asyncio.to_thread(p.read_bytes) for p in logs]
    total = sum(len(c) for c in contents)
    assert total > PACE  # more than a second's worth (the bucket holds a quarter of one)

    started = time.monotonic()
    bodies = await asyncio.gather(*(client.get(f"{base}/logs/{p.name}") for p in logs))
    for content, r in zip(contents, bodies, strict=True):
        assert await r.read() == content
    elapsed = time.monotonic() - started
    assert elapsed >= (total - PACE / 4) / PACE * 0.95, (elapsed, total)

    budget = client.app[READ_BUDGET]
    assert budget.try_take(budget.capacity)  # read replies fill the node's read budget
    try:
        r = await client.get(f"{base}/logs/{logs[0].name}")
        await _error(r, 503, "overloaded")
    finally:
        budget.give_back(budget.capacity)
    assert budget.in_use == 0


def _flip_payload_byte(directory: Path, ledger_id: int, entry_id: int) -> None:
    """A byte of the entry's payload flipped in the log the snapshot holds."""
    rows = pq.read_table(directory / "locations.parquet").to_pylist()
    (row,) = [r for r in rows if (r["ledger_id"], r["entry_id"]) == (ledger_id, entry_id)]
    path = logformat.log_path(directory / kept.LOGS_DIR, row["log_id"])
    with path.open("r+b") as f:
        f.seek(row["offset"] + logformat.RECORD_OVERHEAD + w.ENTRY_SIZE // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def _hide_directory(directory: Path) -> None:
    """The snapshot names a directory nobody has: the job can only read the logs from the
    node (over HTTP)."""
    meta = kept.read_meta(directory)
    meta["ledgersDir"] = "/nonexistent/logs"
    (directory / kept.META_FILE).write_text(json.dumps(meta))


@pytest.mark.timeout(600)  # a Spark session on a busy machine
async def test_the_job_reads_a_snapshot_over_http(
    tmp_path: Path, aiohttp_client: Any, spark: Any
) -> None:
    client, base, directory = await _node_with_snapshot(aiohttp_client, _settings(tmp_path / "d"))
    lid = (await (await client.get("/api/v1/ledgers")).json())["ledgers"][0]["ledgerId"]
    await asyncio.to_thread(_flip_payload_byte, directory, lid, FLIPPED_ENTRY)
    await asyncio.to_thread(_hide_directory, directory)
    url = f"{client.make_url(base)}/"
    out = tmp_path / "out"
    args = ["--snapshot", url, "--out", str(out), "--checks", "crc,index,unindexed"]
    args += ["--split-bytes", str(SPLIT_BYTES)]
    code = await asyncio.to_thread(lambda: job.run(job.build_parser().parse_args(args), spark))
    assert code == job.EXIT_VIOLATIONS
    summary = json.loads(await asyncio.to_thread((out / job.SUMMARY_FILE).read_text))
    assert {name: c["violations"] for name, c in summary["checks"].items()} == {
        "crc": 1,
        "index": 0,
        "unindexed": 0,
    }
    crc = await asyncio.to_thread(pq.read_table, out / "crc.parquet")
    assert crc.select(["ledger_id", "entry_id"]).to_pylist() == [
        {"ledger_id": lid, "entry_id": FLIPPED_ENTRY}
    ]
