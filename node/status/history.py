"""A small in-memory history of the node's own metrics, for the status page: an operator who
port-forwards to one node sees the last minutes of adds, reads and latencies without Grafana.

Every ``status_history_interval_s`` the sampler reads the node's cumulative counters and
histograms (the same objects /metrics renders) and stores the rates and quantiles of the
interval since the previous reading; a bounded ring keeps ``status_history_window_s`` of
them. Quantiles are computed from histogram bucket deltas the way Prometheus's
``histogram_quantile`` does (linear interpolation inside the bucket), so the page and a
Grafana panel over the same metric agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Histogram

from node.storage.clock import Clock

log = logging.getLogger(__name__)

MS_PER_S = 1000.0


@dataclass(slots=True, frozen=True)
class Buckets:
    """A histogram as cumulative counts per upper bound (the last bound is +Inf)."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]

    def minus(self, earlier: Buckets) -> Buckets:
        if earlier.bounds != self.bounds:
            return self  # a histogram replaced under us: take the whole of it
        return Buckets(
            self.bounds,
            tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True)),
        )

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0


@dataclass(slots=True, frozen=True)
class Reading:
    """The node's cumulative figures at one instant."""

    adds: int
    add_bytes: int
    reads: int
    read_bytes: int
    add_latency: Buckets
    fsync_latency: Buckets


@dataclass(slots=True, frozen=True)
class Sample:
    """One interval of the history: rates over it and quantiles of what it observed (None
    when it observed nothing: no adds, no WAL writes)."""

    time_ms: int
    adds_per_s: float
    reads_per_s: float
    add_bytes_per_s: float
    read_bytes_per_s: float
    add_p50_s: float | None
    add_p99_s: float | None
    fsync_p50_s: float | None
    fsync_p99_s: float | None


def quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus's histogram_quantile over cumulative buckets:
    the bucket holding rank q*count, interpolated linearly from its lower bound; a rank in
    the +Inf bucket answers the highest finite bound."""
    total = buckets.count
    if total <= 0 or not buckets.bounds:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, cumulative in zip(buckets.bounds, buckets.cumulative, strict=True):
        if cumulative >= rank:
            if math.isinf(bound):
                return lower_bound
            inside = cumulative - lower_count
            if inside <= 0:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / inside
        lower_bound, lower_count = bound, cumulative
    return lower_bound


def histogram_buckets(histogram: Histogram) -> Buckets:
    """Cumulative buckets of a prometheus-client histogram, summed over its label values."""
    by_bound: dict[float, float] = {}
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                by_bound[bound] = by_bound.get(bound, 0.0) + sample.value
    bounds = tuple(sorted(by_bound))
    return Buckets(bounds, tuple(by_bound[b] for b in bounds))


class History:
    """The ring of samples; ``record`` turns consecutive readings into samples."""

    def __init__(self, interval_s: float, window_s: float, clock: Clock) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        # The bound: one sample per interval over the window, however often record runs.
        self._samples: deque[Sample] = deque(maxlen=max(1, math.ceil(window_s / interval_s)))
        self._clock = clock
        self._last: tuple[float, Reading] | None = None

    def record(self, reading: Reading) -> Sample | None:
        """Take a reading; from the second on, append the interval's sample and return it."""
        now = self._clock.monotonic()
        previous, self._last = self._last, (now, reading)
        if previous is None:
            return None
        then, before = previous
        elapsed = now - then
        if elapsed <= 0:
            return None
        add_latency = reading.add_latency.minus(before.add_latency)
        fsync = reading.fsync_latency.minus(before.fsync_latency)
        sample = Sample(
            time_ms=self._clock.now_ms(),
            adds_per_s=_rate(reading.adds - before.adds, elapsed),
            reads_per_s=_rate(reading.reads - before.reads, elapsed),
            add_bytes_per_s=_rate(reading.add_bytes - before.add_bytes, elapsed),
            read_bytes_per_s=_rate(reading.read_bytes - before.read_bytes, elapsed),
            add_p50_s=quantile(0.5, add_latency),
            add_p99_s=quantile(0.99, add_latency),
            fsync_p50_s=quantile(0.5, fsync),
            fsync_p99_s=quantile(0.99, fsync),
        )
        self._samples.append(sample)
        return sample

    def samples(self) -> list[Sample]:
        """Oldest first, within the window of the newest."""
        return list(self._samples)

    @property
    def capacity(self) -> int:
        return self._samples.maxlen or 0


def _rate(delta: float, elapsed_s: float) -> float:
    # A counter that went down was reset (a replaced engine): count that interval as idle.
    return max(0.0, delta) / elapsed_s


class HistorySampler:
    """Reads the node every interval on the event loop (the figures belong to the loop; a
    reading is a few dict and list copies, nothing blocking) and feeds the history."""

    def __init__(self, history: History, read: Callable[[], Reading], clock: Clock) -> None:
        self.history = history
        self._read = read
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.history.record(self._read())  # the baseline: the first sample comes one interval on
        self._task = asyncio.create_task(self._run(), name="status-history")

    async def _run(self) -> None:
        while True:
            await self._clock.sleep(self.history.interval_s)
            try:
                self.history.record(self._read())
            except Exception:  # a bad reading must not end the history for good
                log.exception("status history: could not sample the node's metrics")

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
