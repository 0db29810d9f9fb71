"""`python -m node bench stream` end to end: a short run prints every row with positive
throughput and latency figures, and the tailing readers received every entry."""

from __future__ import annotations

import re
from pathlib import Path

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
