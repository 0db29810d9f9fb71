"""`python -m node bench offload` end to end: a short run prints its table, with a row per
medium and positive figures, and random reads that fetch at most the index stride."""

from __future__ import annotations

import re
from pathlib import Path

from tests.harness.hostdisk import number, run_bench, table_rows

RUN_TIMEOUT_S = 120  # the run itself takes a few seconds; this only stops a hang
ENTRY_LOG = "entry log (baseline)"
MEDIA = ("local store", "S3 (moto, HTTP on loopback)")
CELLS = 5  # medium, upload MB/s, sequential read MB/s, ratio, bytes per random read
STRIDE = 1024 * 1024  # the default index stride (managed_ledger_offload_read_buffer_size...)


def test_bench_offload_prints_upload_and_read_throughput_per_medium(tmp_path: Path) -> None:
    scratch = tmp_path / "bench"
    result = run_bench(
        "offload",
        "--ledger-mib",
        "3",
        "--entry-size",
        "1000",
        "--random-reads",
        "20",
        "--dir",
        str(scratch),
        timeout_s=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    rows = table_rows(out)
    baselines = [cells for name, cells in rows.items() if name.startswith(ENTRY_LOG)]
    assert len(baselines) == len(MEDIA), out
    assert all(number(cells[2]) > 0 for cells in baselines), out
    for medium in MEDIA:
        cells = rows[medium]
        assert len(cells) == CELLS, out
        assert all(number(cell) > 0 for cell in cells[1:4]), out  # upload, read, ratio
        mean, largest = (number(part) for part in cells[4].split("/"))
        assert 0 < mean <= largest <= STRIDE, out
    assert re.search(r"local store: sequential reads at [0-9,]+% of entry-log reads", out), out
    # It cleans up after itself: nothing left of what it created.
    assert not scratch.exists() or not any(scratch.iterdir())


def test_bench_offload_refuses_a_bad_size(tmp_path: Path) -> None:
    result = run_bench("offload", "--ledger-mib", "0", timeout_s=RUN_TIMEOUT_S)
    assert result.returncode == 2
    assert "--ledger-mib" in result.stderr
