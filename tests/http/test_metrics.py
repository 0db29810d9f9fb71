"""/metrics parses with prometheus-client's parser and moves by the right amounts."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from node.http.frames import encode_batch

OCTET = {"Content-Type": "application/octet-stream"}
BATCH = {"Content-Type": "application/x-entry-batch"}


async def _scrape(client: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = await client.get("/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(await r.text()):
        assert family.name.startswith("storage_node_")
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_move_by_the_right_amounts(client: Any) -> None:
    before = await _scrape(client)
    lid = (await (await client.post("/api/v1/ledgers")).json())["ledgerId"]
    for i in range(7):
        r = await client.post(f"/api/v1/ledgers/{lid}/entries", data=bytes(100 + i), headers=OCTET)
        assert r.status == 201
    r = await client.post(
        f"/api/v1/ledgers/{lid}/entries", data=encode_batch([b"a" * 10] * 5), headers=BATCH
    )
    assert r.status == 201
    for i in range(3):
        assert (await client.get(f"/api/v1/ledgers/{lid}/entries/{i}")).status == 200
    assert (await client.get(f"/api/v1/ledgers/{lid}/entries/99")).status == 404
    after = await _scrape(client)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("storage_node_adds_total") == 12
    assert delta("storage_node_add_payload_bytes_total") == sum(100 + i for i in range(7)) + 50
    assert delta("storage_node_reads_total") == 3
    assert delta("storage_node_add_latency_seconds_count", kind="single") == 7
    assert delta("storage_node_add_latency_seconds_count", kind="batch") == 1
    assert delta("storage_node_read_latency_seconds_count", kind="entry") == 4
    route = "/api/v1/ledgers/{lid}/entries"
    assert (
        delta(
            "storage_node_http_request_duration_seconds_count",
            method="POST",
            route=route,
            status="201",
        )
        == 8
    )
    assert (
        delta(
            "storage_node_http_request_duration_seconds_count",
            method="GET",
            route="/api/v1/ledgers/{lid}/entries/{eid}",
            status="404",
        )
        == 1
    )
    records = delta("storage_node_journal_group_records_sum")
    assert records >= 13  # 12 entries and the ledger's creation, plus group start records
    assert delta("storage_node_journal_group_records_count") >= 1
    assert delta("storage_node_journal_fsync_seconds_count") == delta(
        "storage_node_journal_group_records_count"
    )
    assert _value(after, "storage_node_ledgers", state="open") == 1
    assert _value(after, "storage_node_state", state="writable") == 1
    assert _value(after, "storage_node_read_only") == 0
    assert _value(after, "storage_node_write_cache_bytes") > 0
    assert _value(after, "storage_node_disk_total_bytes", dir="journal") > 0


async def test_checkpoint_and_entry_log_metrics(client: Any) -> None:
    from node.http.state import STORAGE

    lid = (await (await client.post("/api/v1/ledgers")).json())["ledgerId"]
    await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"x" * 1000, headers=OCTET)
    await client.server.app[STORAGE].checkpoint()
    samples = await _scrape(client)
    assert _value(samples, "storage_node_checkpoint_duration_seconds_count") >= 1
    assert _value(samples, "storage_node_entry_logs") == 1
    assert _value(samples, "storage_node_entry_log_bytes") > 1000
    assert _value(samples, "storage_node_index_entries") >= 0
    assert _value(samples, "storage_node_index_size_bytes") > 0
    assert _value(samples, "storage_node_write_cache_bytes") == 0
