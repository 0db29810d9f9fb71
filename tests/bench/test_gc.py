"""`python -m node bench gc` end to end: a short run prints positive figures for every row."""

from __future__ import annotations

import re
from pathlib import Path

from tests.harness.hostdisk import run_bench

RUN_TIMEOUT_S = 120  # the run itself takes a few seconds; this only stops a hang
ALONE = "compaction alone (unthrottled)"
WITHOUT = "writes without compaction"
WITH = "writes with throttled compaction"
ALONE_CELLS = 7  # run, logs, read MB, written MB, seconds, read MB/s, written MB/s
LOAD_CELLS = 5  # run, adds/s, p50 ms, p99 ms, compaction MB/s


def _rows(output: str) -> dict[str, list[str]]:
    """Row name -> its cells, from the markdown tables."""
    rows = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] in (ALONE, WITHOUT, WITH):
            rows[cells[0]] = cells
    return rows


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_bench_gc_prints_compaction_throughput_and_add_latency(tmp_path: Path) -> None:
    scratch = tmp_path / "bench"
    result = run_bench(
        "gc",
        "--seconds",
        "0.5",
        "--writers",
        "2",
        "--window",
        "4",
        "--dir",
        str(scratch),
        timeout_s=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    rows = _rows(out)
    assert set(rows) == {ALONE, WITHOUT, WITH}, out

    alone = rows[ALONE]
    assert len(alone) == ALONE_CELLS, out
    assert all(_number(cell) > 0 for cell in alone[1:]), out  # logs, MB, seconds, MB/s

    for name in (WITHOUT, WITH):
        cells = rows[name]
        assert len(cells) == LOAD_CELLS, out
        assert all(_number(cell) > 0 for cell in cells[1:4]), out  # adds/s, p50, p99
    assert rows[WITHOUT][4] == "-"
    assert _number(rows[WITH][4]) > 0, out  # compaction I/O while the load ran

    ratio = re.search(r"p99 with throttled compaction / without: ([0-9.]+)x", out)
    assert ratio is not None and float(ratio.group(1)) > 0, out
    measured = re.search(r"during the windows: ([0-9.,]+) MB/s .* configured ([0-9.,]+)", out)
    assert measured is not None, out
    assert _number(measured.group(1)) > 0 and _number(measured.group(2)) > 0
    # It cleans up after itself: nothing left of what it created.
    assert not scratch.exists() or not any(scratch.iterdir())
