"""The status page's history ring: rates and quantiles per interval from the node's
cumulative figures, bounded to the window, on an injected clock."""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram

from node.settings import load
from node.status.history import (
    Buckets,
    History,
    HistorySampler,
    Reading,
    histogram_buckets,
    quantile,
)
from tests.harness.clock import FakeClock

BOUNDS = (0.001, 0.01, 0.1, math.inf)
HOUR_S = 3600


def reading(adds: int = 0, add_bytes: int = 0, reads: int = 0, **buckets: Any) -> Reading:
    return Reading(
        adds=adds,
        add_bytes=add_bytes,
        reads=reads,
        read_bytes=reads * 10,
        add_latency=Buckets(BOUNDS, tuple(buckets.get("add", (0, 0, 0, 0)))),
        fsync_latency=Buckets(BOUNDS, tuple(buckets.get("fsync", (0, 0, 0, 0)))),
    )


def test_rates_are_per_second_over_the_interval_since_the_previous_reading() -> None:
    clock = FakeClock()
    history = History(interval_s=5, window_s=60, clock=clock)
    assert history.record(reading()) is None  # the baseline makes no sample
    clock.advance(5)
    sample = history.record(reading(adds=50, add_bytes=5000, reads=10))
    assert sample is not None
    assert (sample.adds_per_s, sample.add_bytes_per_s, sample.reads_per_s) == (10, 1000, 2)
    assert sample.read_bytes_per_s == 20 and sample.time_ms == clock.now_ms()
    clock.advance(10)  # a late tick: the rate is over the real elapsed time
    sample = history.record(reading(adds=60, add_bytes=5000, reads=10))
    assert sample is not None and sample.adds_per_s == 1 and sample.reads_per_s == 0


def test_quantiles_come_from_the_interval_only_and_none_when_it_observed_nothing() -> None:
    clock = FakeClock()
    history = History(interval_s=1, window_s=60, clock=clock)
    # Before the baseline: 100 slow adds (in (0.01, 0.1]); they must not count below.
    history.record(reading(add=(0, 0, 100, 100)))
    clock.advance(1)
    # This interval: 99 adds under 1 ms and one in (0.01, 0.1].
    sample = history.record(reading(add=(99, 99, 200, 200), fsync=(0, 4, 4, 4)))
    assert sample is not None
    assert sample.add_p50_s == pytest.approx(0.001 * 50 / 99)
    assert sample.add_p99_s == pytest.approx(0.001)  # rank 99 is the 99th fast add
    assert sample.fsync_p50_s == pytest.approx(0.001 + 0.009 * 0.5)
    clock.advance(1)
    idle = history.record(reading(add=(99, 99, 200, 200), fsync=(0, 4, 4, 4)))
    assert idle is not None and idle.add_p50_s is None and idle.fsync_p99_s is None


def test_a_rank_in_the_inf_bucket_answers_the_highest_finite_bound() -> None:
    assert quantile(0.99, Buckets(BOUNDS, (0, 0, 1, 10))) == 0.1
    assert quantile(0.5, Buckets(BOUNDS, (0, 0, 0, 0))) is None


def test_the_ring_keeps_the_window_and_drops_the_oldest() -> None:
    clock = FakeClock()
    history = History(interval_s=5, window_s=900, clock=clock)
    assert history.capacity == 180
    history.record(reading())
    for i in range(1, 200):
        clock.advance(5)
        history.record(reading(adds=i))
    samples = history.samples()
    assert len(samples) == 180
    assert samples[-1].time_ms - samples[0].time_ms == 179 * 5000  # oldest first, contiguous


def test_a_counter_that_went_down_counts_as_an_idle_interval() -> None:
    clock = FakeClock()
    history = History(interval_s=1, window_s=10, clock=clock)
    history.record(reading(adds=100))
    clock.advance(1)
    sample = history.record(reading(adds=3))
    assert sample is not None and sample.adds_per_s == 0


def test_buckets_of_a_labelled_histogram_are_summed_over_its_labels() -> None:
    registry = CollectorRegistry()
    latency = Histogram("t_seconds", "test", ["kind"], registry=registry, buckets=BOUNDS[:-1])
    latency.labels("entry").observe(0.0005)
    latency.labels("batch").observe(0.05)
    latency.labels("batch").observe(5)
    buckets = histogram_buckets(latency)
    assert buckets.bounds == BOUNDS
    assert buckets.cumulative == (1, 1, 2, 3)


async def test_the_sampler_takes_one_sample_per_interval_on_the_nodes_clock() -> None:
    """The sampler's loop, driven through several periods at the default interval by the
    fake clock: one sample per period, each over exactly that period, with no real waiting
    (an hour of samples in well under a second)."""
    settings = load()
    clock = FakeClock()
    history = History(settings.status_history_interval_s, settings.status_history_window_s, clock)
    adds = 0

    def read() -> Reading:
        nonlocal adds
        adds += 30
        return reading(adds=adds)

    sampler = HistorySampler(history, read, clock)
    periods = round(HOUR_S / settings.status_history_interval_s)
    started = time.monotonic()
    sampler.start()  # the baseline reading, taken now
    try:
        for _ in range(periods):
            await clock.tick()
        await clock.sleeping()  # the last period's reading is in: the loop sleeps again
    finally:
        await sampler.stop()
    assert time.monotonic() - started < 1.0
    samples = history.samples()
    assert len(samples) == min(periods, history.capacity)
    assert clock.monotonic() == periods * settings.status_history_interval_s
    interval_ms = round(settings.status_history_interval_s * 1000)
    assert [b.time_ms - a.time_ms for a, b in itertools.pairwise(samples)] == [interval_ms] * (
        len(samples) - 1
    )
    assert {s.adds_per_s for s in samples} == {30 / settings.status_history_interval_s}
