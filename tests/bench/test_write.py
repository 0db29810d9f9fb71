"""`python -m node bench write` end to end: a short run prints its rows with figures."""

from __future__ import annotations

import re
from pathlib import Path

from tests.harness.hostdisk import run_bench

ROWS = ("engine", "engine, batches of 10", "raw disk (same batches)", "rocksdb sync")
CPU_LINE = re.compile(
    r"event loop ([0-9.]+) of a core, ([0-9.]+) us of its CPU per (?:add|entry); "
    r"the process ([0-9.]+) cores"
)
FLUSH_LINE = re.compile(
    r"flush thread: ([0-9]+) checkpoints flushed ([0-9,]+) entries in ([0-9.]+) s: "
    r"([0-9,]+) entries/s of flush thread time, busy ([0-9]+)% of the window"
)
RUN_TIMEOUT_S = 120  # the run itself takes a few seconds; this only stops a hang


def _entries_per_s(output: str) -> dict[str, float]:
    """Row name -> entries/s, from the markdown table rows ``| name | entries/s | ...``."""
    figures: dict[str, float] = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in ROWS:
            figures[cells[0]] = float(cells[1].replace(",", ""))
    return figures


def test_bench_write_prints_positive_figures_for_its_rows(tmp_path: Path) -> None:
    scratch = tmp_path / "bench"
    result = run_bench(
        "write",
        "--seconds",
        "0.5",
        "--writers",
        "2",
        "--sizes",
        "1024",
        "--batch",
        "10",
        "--dir",
        str(scratch),
        timeout_s=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert "entry size 1,024 B" in result.stdout
    assert "- engine, batches of 10: " in result.stdout  # its journal line
    figures = _entries_per_s(result.stdout)
    assert set(figures) == set(ROWS), result.stdout
    for name, value in figures.items():
        assert value > 0, f"{name}: {value} entries/s\n{result.stdout}"
    # Where the CPU went, for the single and the batched row: the loop's share of a core
    # (one thread cannot use more than the window's length) and its CPU per add or entry.
    cpu = CPU_LINE.findall(result.stdout)
    assert len(cpu) == 2, result.stdout
    for busy, per_add_us, cores in cpu:
        assert 0 < float(busy) <= 1.05, result.stdout
        assert float(per_add_us) > 0, result.stdout
        assert float(cores) >= float(busy) - 0.05, result.stdout
    # The checkpoints' flush thread, for both rows (a short window may hold none).
    assert len(FLUSH_LINE.findall(result.stdout)) == 2, result.stdout
    # It cleans up after itself: nothing left of what it created.
    assert not scratch.exists() or not any(scratch.iterdir())


def test_bench_write_refuses_a_batch_of_one() -> None:
    result = run_bench("write", "--batch", "1", timeout_s=RUN_TIMEOUT_S)
    assert result.returncode == 2
    assert "--batch must be 0 (no batched row) or at least 2" in result.stderr


HTTP_ROWS = ("http single", "http batch", "http read", "engine single", "engine batch")


def test_bench_http_prints_figures_for_every_run(tmp_path: Path) -> None:
    result = run_bench(
        "http",
        "--seconds",
        "0.5",
        "--writers",
        "4",
        "--dir",
        str(tmp_path),
        timeout_s=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] in HTTP_ROWS:
            rows[cells[0]] = float(cells[2].replace(",", ""))  # entries/s
    assert set(rows) == set(HTTP_ROWS), result.stdout
    assert all(value > 0 for value in rows.values()), result.stdout
    assert "batch ingest over HTTP / in-process engine batches:" in result.stdout
    assert not any(tmp_path.iterdir())  # its scratch directory is gone
