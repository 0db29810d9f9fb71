"""`python -m node bench stream --replicated`: end to end on a real local cluster (etcd and four
node processes) and a single node, every row with positive figures and no errors, the ratio
lines with their targets, the scratch directory gone; and the ratio lines' arithmetic and
verdicts on figures made up for them."""

from __future__ import annotations

import re
from pathlib import Path

from node.bench.stream_replicated import (
    BATCH_TARGET,
    FORWARD_TARGET,
    FORWARDED,
    REPLICATED,
    SINGLE_NODE,
    Row,
    ratio_lines,
    table,
)
from tests.harness.hostdisk import number, run_bench, table_rows

RUN_TIMEOUT_S = 300  # seven short runs, a node's and a cluster's start; this only stops a hang
WRITERS = 2
SHAPES = (
    f"batch appends (100 x 1 KiB), {WRITERS} writers",
    f"single appends, {WRITERS} writers",
    "one append at a time",
)
HEADER = ("run", "requests/s", "entries/s", "MB/s", "p50 ms", "p99 ms", "errors", "server cores")
RATIO = re.compile(r"^- (.+): replicated / single node entries/s = ([\d.]+)x", re.MULTILINE)
TARGET = re.compile(r"\(target (>=|<=) ([\d.]+)x: (met|MISSED)\)")
FORWARD = re.compile(
    r"^- one append at a time: forwarded \(to a non-owner\) / owner p50 = ([\d.]+)x", re.MULTILINE
)


def test_bench_stream_replicated_prints_both_sides_and_the_forwarded_append(
    tmp_path: Path,
) -> None:
    scratch = tmp_path / "bench"
    result = run_bench(
        "stream",
        "--replicated",
        "--seconds",
        "0.5",
        "--writers",
        str(WRITERS),
        "--dir",
        str(scratch),
        timeout_s=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = table_rows(result.stdout)
    assert tuple(rows["run"]) == HEADER, result.stdout
    expected = {f"{shape}, {side}" for shape in SHAPES for side in (SINGLE_NODE, REPLICATED)}
    expected.add(f"one append at a time, {FORWARDED}")
    assert {name for name in rows if not name.startswith("-")} - {"run"} == expected, result.stdout
    for name in expected:
        _, requests_per_s, entries_per_s, mb_per_s, p50, p99, errors, cores = rows[name]
        assert number(requests_per_s) > 0 and number(entries_per_s) > 0, (name, result.stdout)
        assert number(mb_per_s) > 0
        assert 0 < number(p50) <= number(p99), (name, result.stdout)
        assert errors == "0", (name, result.stdout)
        assert number(cores) > 0, (name, result.stdout)
    ratios = {m[1]: float(m[2]) for m in RATIO.finditer(result.stdout)}
    assert set(ratios) == set(SHAPES) and all(r > 0 for r in ratios.values()), result.stdout
    targets = TARGET.findall(result.stdout)
    assert [(op, float(x)) for op, x, _ in targets] == [
        (">=", BATCH_TARGET),
        ("<=", FORWARD_TARGET),
    ], result.stdout
    forward = FORWARD.search(result.stdout)
    assert forward is not None and float(forward[1]) > 0, result.stdout
    assert not scratch.exists() or not any(scratch.iterdir())  # the cluster's data is gone


def row(name: str, entries: int, p50_s: float) -> Row:
    return Row(name=name, requests=entries, entries=entries, seconds=1.0, latencies=[p50_s])


def test_ratio_lines_compare_each_shape_and_the_forwarded_append() -> None:
    batch = SHAPES[0]
    one = "one append at a time"
    rows = [
        row(f"{batch}, {SINGLE_NODE}", 1000, 0.010),
        row(f"{one}, {SINGLE_NODE}", 100, 0.001),
        row(f"{batch}, {REPLICATED}", 250, 0.020),
        row(f"{one}, {REPLICATED}", 50, 0.002),
        row(f"{one}, {FORWARDED}", 40, 0.004),
    ]
    assert ratio_lines(rows) == [
        f"- {batch}: replicated / single node entries/s = 0.25x (target >= 0.3x: MISSED); "
        "p50 = 2.00x",
        f"- {one}: replicated / single node entries/s = 0.50x; p50 = 2.00x",
        "- one append at a time: forwarded (to a non-owner) / owner p50 = 2.00x "
        "(target <= 1.5x: MISSED)",
    ]
    rows[2] = row(f"{batch}, {REPLICATED}", 300, 0.020)
    rows[4] = row(f"{one}, {FORWARDED}", 40, 0.003)
    lines = ratio_lines(rows)
    assert "(target >= 0.3x: met)" in lines[0] and "(target <= 1.5x: met)" in lines[2]
    assert ratio_lines(rows[:2]) == []  # no replicated side: nothing to compare
    cells = table_rows("\n".join(table(rows)))
    assert cells[f"{one}, {FORWARDED}"][1:] == ["40", "40", "0.0", "3.00", "3.00", "0", "-"]
