"""`python -m node bench http --peer redis` and `bench replay` end to end: short runs print
every row with figures, and the ratios they are for."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.harness.hostdisk import number, run_bench, table_rows

RUN_TIMEOUT_S = 300  # the runs take well under a minute; this only stops a hang
SHAPES = ("4 x batch 100", "8 x batch 100", "16 x single")


def test_bench_http_peer_redis_prints_both_servers_and_their_ratios(tmp_path: Path) -> None:
    assert shutil.which("redis-server"), "redis-server is missing: `make tools` installs it"
    result = run_bench(
        "http", "--peer", "redis", "--seconds", "0.3", "--rounds", "1", "--dir", str(tmp_path),
        timeout_s=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    for shape in SHAPES:
        for target in ("node", "redis"):
            row = rows[f"{target} {shape}"]
            assert number(row[2]) > 0, result.stdout  # entries/s
        node, redis, ratio = (number(cell) for cell in rows[shape][1:4])
        assert abs(ratio - node / redis) < 0.01, result.stdout
    assert not any(tmp_path.iterdir())  # the scratch data (both servers') is gone


def test_bench_replay_replays_every_record_the_crash_left(tmp_path: Path) -> None:
    result = run_bench(
        "replay", "--replay-mib", "4", "--dir", str(tmp_path), timeout_s=RUN_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    # 40 batches of 100 entries, or 4,096 single adds; and the 16 ledgers' creation records:
    # all of them replayed.
    shapes = {"batches of 100": 4 * 1024 * 1024 // (1024 * 100) * 100, "single adds": 4096}
    for shape, entries in shapes.items():
        scan, start = (
            f"journal scan (framing, CRC), {shape}",
            f"node start (replay, flush, checkpoint), {shape}",
        )
        assert number(rows[scan][3]) == entries + 16, result.stdout
        assert number(rows[start][3]) == entries + 16, result.stdout
        assert number(rows[start][2]) > 0, result.stdout  # MB/s
    assert number(rows["read + CRC32C (baseline)"][2]) > 0, result.stdout
    assert "MB/s of entries with single adds" in result.stdout
