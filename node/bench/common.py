"""What the benchmarks share: units, warm-up, latency buffers and quantiles, the measured
window, markdown tables, the scratch directory, the report's machine line, argument checks."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import platform
import shutil
import tempfile
import time
from array import array
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from node.storage.errors import Backpressure

if TYPE_CHECKING:
    from node.storage.ledgers import LedgerStorage

MB = 1_000_000  # MB/s in decimal megabytes, as disk vendors and fio report them
MS_PER_S = 1000.0  # latencies are printed in milliseconds
WARMUP_FRACTION = 0.2  # warm-up before each measured run, as a share of --seconds ...
WARMUP_MAX_S = 1.0  # ... but never longer than this
PAYLOAD_FILL = 0xA5  # payload byte: not zero, so no layer can treat the data as a hole
P50 = 0.50  # median
P99 = 0.99  # tail
LATENCIES = "d"  # array of C doubles: compact, and no objects for the GC to walk
EXIT_USAGE = 2  # exit code for bad arguments (argparse's convention)


class UsageError(Exception):
    """Bad arguments: ``node.bench.main`` prints the message and exits with EXIT_USAGE."""


# --- arguments -------------------------------------------------------------------------------


def require_positive(**options: float) -> None:
    """UsageError unless every option (``--name`` = value) is positive."""
    if all(value > 0 for value in options.values()):
        return
    names = [f"--{name.replace('_', '-')}" for name in options]  # as typed: --ledger-mib
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    raise UsageError(f"{listed} must be positive")


def parse_sizes(option: str, text: str, limit: int, limit_name: str = "") -> list[int]:
    """Comma-separated sizes in [1, ``limit``] (``limit_name``: the setting it comes from)."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not sizes or any(not 0 < s <= limit for s in sizes):
        named = f" ({limit_name})" if limit_name else ""
        raise UsageError(f"{option} must be in [1, {limit}]{named}, got {text!r}")
    return sizes


def warmup_for(seconds: float) -> float:
    """The warm-up before a measured run of ``seconds``."""
    return min(WARMUP_MAX_S, seconds * WARMUP_FRACTION)


# --- latencies and the measured window -------------------------------------------------------


def latency_buffer() -> array[float]:
    return array(LATENCIES)


def quantile_ms(latencies: Sequence[float], quantile: float, *, ordered: bool = False) -> float:
    """Nearest-rank quantile of ``latencies`` (seconds) in milliseconds, 0 when there are
    none. ``ordered``: they are sorted already."""
    if not latencies:
        return 0.0
    if not ordered:
        latencies = sorted(latencies)
    return latencies[min(len(latencies) - 1, int(quantile * len(latencies)))] * MS_PER_S


class Phase:
    """Flags the load polls (cheaper than events on the per-operation path): keep going,
    and record what completes."""

    __slots__ = ("recording", "running")

    def __init__(self) -> None:
        self.running = True
        self.recording = False

    async def record(self, seconds: float) -> float:
        """The measured window: recording for ``seconds``; returns its exact length."""
        self.recording = True
        started = time.perf_counter()
        await asyncio.sleep(seconds)
        self.recording = False
        return time.perf_counter() - started

    def record_blocking(self, seconds: float) -> float:
        """The same for a load of threads."""
        self.recording = True
        started = time.perf_counter()
        time.sleep(seconds)
        self.recording = False
        return time.perf_counter() - started


@dataclass(slots=True)
class Result:
    """One measured run: completed writes in ``seconds`` and their latencies (seconds)."""

    name: str
    entries: float  # entries written (payload-equivalent for bench write's raw disk)
    payload_bytes: float
    seconds: float
    latencies: list[float] = field(repr=False)  # a run's task result is repr'd at exit

    @property
    def entries_per_s(self) -> float:
        return self.entries / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.payload_bytes / self.seconds / MB if self.seconds > 0 else 0.0

    def latency_ms(self, quantile: float) -> float:
        """Nearest-rank quantile; call ``sort_latencies`` first."""
        return quantile_ms(self.latencies, quantile, ordered=True)

    def sort_latencies(self) -> None:
        self.latencies.sort()


class AddLoad(Phase):
    """Adds of ``payload`` to the engine, ``window`` in flight on each of ``ledgers``, as a
    BookKeeper client's writers: one slot coroutine per add in flight (no task per add). An
    add's latency runs from the call to ``add_entry`` until it returns (durable). With
    ``batch`` > 1, each add is one ``add_entries`` of ``batch`` copies of ``payload``, as a
    client batching its entries (Pulsar's producer, Kafka's) sends them."""

    __slots__ = ("_tasks", "batch", "latencies", "rejected")

    def __init__(
        self,
        storage: LedgerStorage,
        ledgers: list[int],
        window: int,
        payload: bytes,
        batch: int = 1,
    ) -> None:
        super().__init__()
        self.batch = batch  # entries per add: latencies count adds, entries = adds * batch
        self.rejected = 0  # adds refused with Backpressure; not in the figures
        self.latencies = [latency_buffer() for _ in range(len(ledgers) * window)]
        add: Callable[..., Awaitable[object]]
        after_ledger: tuple[object, ...]
        if batch == 1:
            add, after_ledger = storage.add_entry, (None, payload)
        else:
            add, after_ledger = storage.add_entries, ([payload] * batch,)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._slot(add, (ledgers[i // window], *after_ledger), buffer.append))
            for i, buffer in enumerate(self.latencies)
        ]

    async def _slot(
        self,
        add: Callable[..., Awaitable[object]],
        args: tuple[object, ...],
        record: Callable[[float], None],
    ) -> None:
        clock = time.perf_counter
        while self.running:
            started = clock()
            try:
                await add(*args)
            except Backpressure:
                self.rejected += 1
                continue
            finished = clock()
            if self.recording:
                record(finished - started)

    def take(self) -> list[float]:
        """The latencies recorded so far, all slots together; the buffers start afresh."""
        merged = [x for buffer in self.latencies for x in buffer]
        for buffer in self.latencies:
            del buffer[:]
        return merged

    async def stop(self) -> None:
        self.running = False
        await asyncio.gather(*self._tasks)


# --- the report ------------------------------------------------------------------------------


def markdown_table(header: tuple[str, ...], cells: Sequence[tuple[str, ...]]) -> list[str]:
    """Lines of a markdown table: the first column left aligned, the figures right."""
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]

    def line(values: tuple[str, ...]) -> str:
        first = values[0].ljust(widths[0])
        rest = (v.rjust(w) for v, w in zip(values[1:], widths[1:], strict=True))
        return "| " + " | ".join([first, *rest]) + " |"

    rule = "|" + "|".join(["-" * (widths[0] + 2)] + ["-" * (w + 1) + ":" for w in widths[1:]]) + "|"
    return [line(header), rule, *(line(c) for c in cells)]


def machine_line(scratch: Path) -> str:
    """The report's line on where it ran: the scratch directory and its file system, Python,
    the event loop, the CPUs."""
    return (
        f"- scratch: {scratch} ({_filesystem(scratch)}); python {platform.python_version()}, "
        f"{_loop_name()}, {os.cpu_count()} CPUs"
    )


def _filesystem(path: Path) -> str:
    """``<type> on <device>`` of the mount holding ``path`` (Linux), else "unknown"."""
    best, found = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                device, mount_point, fs_type, *_ = line.split()
                inside = str(path).startswith(mount_point.rstrip("/") + "/")
                if (inside or str(path) == mount_point) and len(mount_point) > len(best):
                    best, found = mount_point, f"{fs_type} on {device}"
    except OSError:
        pass
    return found


def _loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return f"uvloop {importlib.metadata.version('uvloop')}"


# --- scratch data ----------------------------------------------------------------------------


@contextlib.contextmanager
def scratch_dir(parent: Path | None, prefix: str) -> Iterator[Path]:
    """A fresh directory for one benchmark's data, in ``parent`` (``--dir``; created if
    missing) or else in the system's temporary directory. At the end it is removed with all
    it holds, and so are the directories made for ``parent`` that nothing else was put in."""
    created: list[Path] = []  # deepest first
    if parent is not None:
        parent = parent.resolve()
        created = [p for p in (parent, *parent.parents) if not p.exists()]
        parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for directory in created:
            with contextlib.suppress(OSError):  # someone put files there meanwhile: leave it
                directory.rmdir()
