"""Scraping the node's /metrics with prometheus-client's parser."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]


def parse_samples(text: str) -> Samples:
    """Every sample of an exposition in Prometheus's text format, by (name, sorted labels);
    every family is the node's own."""
    samples = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("storage_node_")
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def scrape(client: Any) -> Samples:
    """The samples of the node behind an aiohttp test client."""
    r = await client.get("/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return parse_samples(await r.text())
