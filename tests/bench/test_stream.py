"""`python -m node bench stream` end to end: a short run prints every row with positive
throughput and latency figures, and the tailing readers received every entry."""

from __future__ import annotations

import re
from pathlib import Path

from node.bench.server import Figures
from node.bench.stream import BATCH, BATCH_DEDUP, SINGLE, SINGLE_DEDUP, dedup_lines, dedup_runs
from tests.harness.hostdisk import run_bench

RUN_TIMEOUT_S = 180  # the run itself takes about fifteen seconds; this only stops a hang
WRITERS = 2
COLUMNS = 10  # run, appends/s, entries/s, MB/s, append p50/p99, e2e p50/p99, ledgers, cores
ROWS = (
    f"single appends, {WRITERS} writers",
    f"batch appends (100 x 1 KiB), {WRITERS} writers",
    "tail (long poll), 1 writer",
    f"tail (long poll), {WRITERS} writers",
    f"tail (cursor + ack), {WRITERS} writers",
)
TAILS = ROWS[2:]
DELIVERED = re.compile(r"- (.+): the reader received ([\d,]+) of the ([\d,]+) entries")


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_bench_stream_prints_throughput_and_end_to_end_latency(tmp_path: Path) -> None:
    result = run_bench(
        "stream",
        "--seconds",
        "0.3",
        "--writers",
        str(WRITERS),
        "--dir",
        str(tmp_path),
        timeout_s=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == COLUMNS and cells[0] in ROWS:
            rows[cells[0]] = cells[1:]
    assert set(rows) == set(ROWS), result.stdout
    for name, cells in rows.items():
        appends_per_s, entries_per_s, _mb_per_s, p50, p99, e2e_p50, e2e_p99, ledgers, _ = cells
        assert _number(appends_per_s) > 0 and _number(entries_per_s) > 0, result.stdout
        assert 0 < _number(p50) <= _number(p99), result.stdout
        assert _number(ledgers) >= 1
        if name in TAILS:
            assert 0 < _number(e2e_p50) <= _number(e2e_p99), result.stdout
        else:
            assert (e2e_p50, e2e_p99) == ("-", "-")
    batch = rows[ROWS[1]]
    assert _number(batch[2]) > 0  # MB/s
    delivered = {m[1]: (_number(m[2]), _number(m[3])) for m in DELIVERED.finditer(result.stdout)}
    assert set(delivered) == set(TAILS), result.stdout
    for received, appended in delivered.values():
        assert received == appended > 0, result.stdout
    assert not any(tmp_path.iterdir())  # its scratch directory is gone


def test_dedup_runs_alternate_so_that_the_later_runs_are_not_one_sides() -> None:
    runs = dedup_runs(WRITERS)
    for plain, with_headers in ((SINGLE, SINGLE_DEDUP), (BATCH, BATCH_DEDUP)):
        modes = [mode for _, mode, _ in runs if mode in (plain, with_headers)]
        assert modes == [plain, with_headers, with_headers, plain]
    assert len({name for name, _, _ in runs}) == len(runs) == 8


def test_dedup_lines_compare_all_runs_and_the_best() -> None:
    """A node whose CPU per entry grows run by run (its data grows) charges the last run
    most: with the runs in turn, the ratio over all runs shows the headers' cost alone."""
    runs = [(name, mode) for name, mode, _ in dedup_runs(WRITERS) if mode in (BATCH, BATCH_DEDUP)]
    drift = [1.0, 1.2, 1.4, 1.6]  # the CPU per entry of runs 1..4, headers or not
    cost = {BATCH: 1.0, BATCH_DEDUP: 1.1}
    rows = [
        Figures(name, 10, 1_000, 1.0, [], server_cpu_s=cost[mode] * grown)
        for (name, mode), grown in zip(runs, drift, strict=True)
    ]
    lines = dedup_lines(rows, [mode for _, mode in runs])
    assert lines[-1] == (
        "- batch appends: CPU per entry with producer headers / without = 1.10x over all "
        "runs, 1.32x of the best runs (target <= 1.2x: met)"
    )
