"""A node with thousands of streams: /metrics and the status summary the page polls stay
small (per-stream series and rows for the ``metrics_max_streams`` streams with the largest
backlog, aggregates over all), and a paged route lists every stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from node.http import models
from node.http.app import build_app
from node.settings import Settings
from node.wire import encode_batch
from tests.harness.settings import make_settings

BATCH = {"Content-Type": "application/x-entry-batch"}
MANY = 10_000  # where unbounded series made 11.4 MB of /metrics and a 2.2 MB summary before
CONCURRENCY = 32
# With MANY streams, at defaults (100 streams with series, 14 series each): ~140 KB, ~1,900
# lines measured, against 10.3 MB and 140,557 lines without the bound.
METRICS_MAX_BYTES = 256 * 1024
METRICS_MAX_LINES = 3_000
SUMMARY_MAX_BYTES = 64 * 1024  # 23 KB measured (100 streams), against 1.9 MB
PER_STREAM = (  # every family labelled by stream
    "storage_node_stream_append_entries",
    "storage_node_stream_append_payload_bytes",
    "storage_node_stream_rollovers",
    "storage_node_stream_ledgers",
    "storage_node_stream_retained_bytes",
    "storage_node_stream_backlog_entries",
    "storage_node_stream_backlog_bytes",
    "storage_node_stream_oldest_unacknowledged_age_seconds",
    "storage_node_stream_retention_deleted_ledgers",
    "storage_node_stream_retention_deleted_bytes",
)


def _name(i: int) -> str:
    return f"s{i:05d}"


async def _ok(response: Any) -> Any:
    assert response.status < 300, await response.text()
    return await response.json()


async def _gather(count: int, one: Callable[[int], Awaitable[None]]) -> None:
    limit = asyncio.Semaphore(CONCURRENCY)

    async def bounded(i: int) -> None:
        async with limit:
            await one(i)

    await asyncio.gather(*(bounded(i) for i in range(count)))


async def _make_streams(client: Any, count: int, backlogs: dict[int, int]) -> None:
    """``count`` streams with one cursor each at the start; stream i gets ``backlogs[i]``
    entries (one batch) that its cursor has not acknowledged."""

    async def one(i: int) -> None:
        await _ok(await client.put(f"/api/v1/streams/{_name(i)}", json={}))
        path = f"/api/v1/streams/{_name(i)}/cursors/c"
        await _ok(await client.put(path, json={"start": "earliest"}))
        if backlogs.get(i):
            body = encode_batch([b"x" * 10] * backlogs[i])
            await _ok(
                await client.post(f"/api/v1/streams/{_name(i)}/entries", data=body, headers=BATCH)
            )

    await _gather(count, one)


async def _metrics(client: Any) -> tuple[str, dict[str, set[str]], dict[Any, float]]:
    """The text, the streams each per-stream family names, and every sample."""
    r = await client.get("/metrics")
    text = await r.text()
    assert r.status == 200
    streams: dict[str, set[str]] = {family: set() for family in PER_STREAM}
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
            if family.name in streams:
                streams[family.name].add(sample.labels["stream"])
    return text, streams, samples


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def test_ten_thousand_streams_at_defaults_keep_metrics_and_the_summary_small(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    settings = make_settings(tmp_path / "d")
    shown = Settings.model_fields["metrics_max_streams"].default
    client = await aiohttp_client(build_app(settings))
    # 150 streams spread over the names with distinct backlogs (1..150 entries): the 100
    # largest are the ones with series; the other 9,850 have no backlog.
    spread = MANY // 150
    backlogs = {k * spread: k + 1 for k in range(150)}
    started = time.monotonic()
    await _make_streams(client, MANY, backlogs)
    print(f"{MANY} streams made in {time.monotonic() - started:.1f} s")
    largest = sorted(backlogs, key=backlogs.__getitem__, reverse=True)[:shown]

    started = time.monotonic()
    text, streams, samples = await _metrics(client)
    print(f"/metrics: {len(text):,} bytes, {text.count(chr(10)):,} lines, ", end="")
    print(f"{time.monotonic() - started:.3f} s")
    assert len(text.encode()) < METRICS_MAX_BYTES
    assert text.count("\n") < METRICS_MAX_LINES
    for family in PER_STREAM:
        assert streams[family] == {_name(i) for i in largest}, family
    assert _value(samples, "storage_node_streams") == MANY
    assert _value(samples, "storage_node_streams_cursors") == MANY
    assert _value(samples, "storage_node_streams_backlog_entries") == sum(backlogs.values())
    assert _value(samples, "storage_node_streams_backlog_bytes") == 10 * sum(backlogs.values())
    assert _value(samples, "storage_node_streams_retained_bytes") == 10 * sum(backlogs.values())
    assert _value(samples, "storage_node_streams_oldest_unacknowledged_age_seconds") > 0

    r = await client.get("/api/v1/status/summary")
    body = await r.read()
    print(f"summary: {len(body):,} bytes")
    assert len(body) < SUMMARY_MAX_BYTES
    summary = models.StatusSummary.model_validate_json(body)
    assert [s.name for s in summary.streams] == [_name(i) for i in largest]  # largest first
    assert [s.cursors[0].backlogEntries for s in summary.streams] == [backlogs[i] for i in largest]
    totals = summary.streamTotals
    assert (totals.streams, totals.shown, totals.cursors) == (MANY, shown, MANY)
    assert totals.backlogEntries == sum(backlogs.values())

    # The full list, a page at a time, for what the summary leaves out.
    listed: list[str] = []
    while True:
        page = models.StatusStreamPage.model_validate(
            await _ok(await client.get(f"/api/v1/status/streams?offset={len(listed)}&limit=1000"))
        )
        assert page.total == MANY
        if not page.streams:
            break
        listed += [s.name for s in page.streams]
    assert listed == [_name(i) for i in range(MANY)]


async def test_the_bound_picks_the_largest_backlogs_and_aggregates_cover_the_rest(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    settings = make_settings(tmp_path / "d", metrics_max_streams=2)
    client = await aiohttp_client(build_app(settings))
    await _make_streams(client, 4, {1: 5, 3: 2})
    # s00004 retains the most bytes, but its cursor acknowledged them all: it ranks after
    # the two streams with a backlog.
    rolling = {"maxEntriesPerLedger": 3, "minLedgerRolloverTimeMinutes": 0}
    path = f"/api/v1/streams/{_name(4)}"
    await _ok(await client.put(path, json={**rolling, "retentionSizeInMB": 0}))
    await _ok(await client.put(f"{path}/cursors/c", json={"start": "earliest"}))
    for _ in range(2):
        body = encode_batch([b"y" * 10] * 3)
        await _ok(await client.post(f"{path}/entries", data=body, headers=BATCH))
    last = (await _ok(await client.get(path)))["ledgers"][-1]
    position = f"{last['ledgerId']}:{last['entries'] - 1}"
    await _ok(await client.post(f"{path}/cursors/c/ack", json={"position": position}))

    _, streams, samples = await _metrics(client)
    for family in PER_STREAM:
        assert streams[family] == {_name(1), _name(3)}, family
    assert _value(samples, "storage_node_streams") == 5
    assert _value(samples, "storage_node_streams_cursors") == 5
    assert _value(samples, "storage_node_streams_backlog_entries") == 7
    assert _value(samples, "storage_node_streams_retained_bytes") == 70 + 60
    summary = await _ok(await client.get("/api/v1/status/summary"))
    assert [s["name"] for s in summary["streams"]] == [_name(1), _name(3)]
    assert summary["streamTotals"]["streams"] == 5 and summary["streamTotals"]["shown"] == 2

    # Retention deletes s00004's acknowledged ledgers (size 0): the node-wide counters count
    # them though the stream has no series of its own.
    deleted = (await _ok(await client.post("/api/v1/retention/run")))["streams"][_name(4)]
    assert deleted
    _, streams, samples = await _metrics(client)
    assert _name(4) not in streams["storage_node_stream_retention_deleted_ledgers"]
    by_size = {"reason": "size"}
    assert _value(samples, "storage_node_retention_deleted_ledgers_total", **by_size) == len(
        deleted
    )
    assert _value(samples, "storage_node_retention_deleted_bytes_total", **by_size) == 30 * len(
        deleted
    )

    for query, code in (("limit=0", "invalid_limit"), ("limit=1001", "invalid_limit")):
        r = await client.get(f"/api/v1/status/streams?{query}")
        assert r.status == 400 and (await r.json())["code"] == code
    r = await client.get("/api/v1/status/streams?offset=-1")
    assert r.status == 400 and (await r.json())["code"] == "invalid_id"

    # One stream with many cursors: its series and rows are bounded too (the limit, in all,
    # the largest backlogs first), while the totals count every cursor.
    for i in range(10):
        path = f"/api/v1/streams/{_name(1)}/cursors/more-{i}"
        await _ok(await client.put(path, json={"start": "earliest"}))
    _, streams, samples = await _metrics(client)
    per_cursor = [name for name, _ in samples if name == "storage_node_stream_backlog_entries"]
    assert len(per_cursor) == 2
    assert _value(samples, "storage_node_streams_cursors") == 15
    assert _value(samples, "storage_node_streams_backlog_entries") == 7 + 10 * 5
    summary = await _ok(await client.get("/api/v1/status/summary"))
    rows = {s["name"]: s for s in summary["streams"]}
    assert (len(rows[_name(1)]["cursors"]), rows[_name(1)]["cursorCount"]) == (2, 11)
    assert (rows[_name(3)]["cursors"], rows[_name(3)]["cursorCount"]) == ([], 1)
