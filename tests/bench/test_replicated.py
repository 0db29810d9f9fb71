"""`python -m node bench replicated` end to end, on a real local cluster (etcd and three node
processes): a short run of the append rows prints every row with positive figures, the CPU of
every process, and a ratio line per pair with its target; a short run of the read rows reads
every entry written, each the one written there; its scratch directory (cluster data
included) is gone. Then the read check on made-up pages: a wrong entry fails the bench."""

from __future__ import annotations

import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

from node.bench.replicated import (
    READ_TARGET,
    REPLICATED,
    Row,
    _timed_read,
    read_failures,
    read_ratio_lines,
    read_shape,
)
from node.bench.server import indexed_payload
from node.runtime import run
from tests.harness.hostdisk import number, run_bench, table_rows

RUN_TIMEOUT_S = 300  # six short runs and a cluster's start; this only stops a hang
WRITERS, WINDOW = 2, 4
SHAPES = (
    f"batches of 100 x 1 KiB, {WRITERS} writers",
    f"single adds, {WRITERS} writers x {WINDOW}",
    "one add at a time",
)
COPIES = ("single copy", "E=3 Qw=3 Qa=2")
PROCESSES = ("client", "n0", "n1", "n2", "etcd")
HEADER = (
    "run",
    "entries/s",
    "MB/s",
    "add p50 ms",
    "add p99 ms",
    "errors",
    *(f"{name} cores" for name in PROCESSES),
)
RATIO = re.compile(
    r"^- (.+): replicated / single copy (entries/s|p50) = ([\d.]+)x "
    r"\(target (>=|<=) ([\d.]+)x: (met|MISSED)\)",
    re.MULTILINE,
)


def _bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A short run of the bench, with ``args``; it succeeded and left no data behind."""
    scratch = tmp_path / "bench"
    result = run_bench("replicated", *args, "--dir", str(scratch), timeout_s=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout, result.stdout
    assert not scratch.exists() or not any(scratch.iterdir())  # the cluster's data is gone
    return result


def test_bench_replicated_prints_both_copies_for_every_shape(tmp_path: Path) -> None:
    result = _bench(
        tmp_path,
        *("--rows", "appends", "--seconds", "0.5"),
        *("--writers", str(WRITERS), "--window", str(WINDOW)),
    )
    rows = table_rows(result.stdout)
    assert tuple(rows["run"]) == HEADER, result.stdout
    expected = {f"{shape}, {copies}" for shape in SHAPES for copies in COPIES}
    assert {name for name in rows if not name.startswith("-")} - {"run"} == expected, (
        result.stdout  # no read row: --rows appends
    )
    for name in expected:
        _, entries_per_s, mb_per_s, p50, p99, errors, *cores = rows[name]
        assert number(entries_per_s) > 0 and number(mb_per_s) > 0, (name, result.stdout)
        assert 0 < number(p50) <= number(p99), (name, result.stdout)
        assert errors == "0", (name, result.stdout)
        assert len(cores) == len(PROCESSES)
        assert number(cores[0]) > 0, (name, result.stdout)  # the client worked
        # Every node a ledger of this row was placed on worked; with three copies, all three.
        nodes = [number(c) for c in cores[1:4]]
        assert (min(nodes) if "E=3" in name else max(nodes)) > 0, (name, result.stdout)
    ratios = {m[1]: m for m in RATIO.finditer(result.stdout)}
    assert set(ratios) == set(SHAPES), result.stdout
    assert ratios[SHAPES[0]][2] == "entries/s" and ratios[SHAPES[0]][5] == "0.3"
    assert all(ratios[s][2] == "p50" and ratios[s][5] == "2.0" for s in SHAPES[1:])
    assert all(float(m[3]) > 0 for m in ratios.values()), result.stdout


ENTRIES, PAGE = 700, 300  # three pages, the last one short
HOW = ("range reads from one node (HTTP)", "ReadHandle.read (client)")
READ_HEADER = (
    "run",
    "entries/s",
    "MB/s",
    "page p50 ms",
    "page p99 ms",
    "misread",
    *(f"{name} cores" for name in PROCESSES),
)
READ_RATIO = re.compile(
    r"^- (.+): ReadHandle\.read \(client\), (.+) / one node's range reads entries/s = "
    r"([\d.]+)x \(target >= ([\d.]+)x: (met|MISSED)\)$",
    re.MULTILINE,
)


def test_bench_replicated_reads_a_closed_ledger_both_ways(tmp_path: Path) -> None:
    result = _bench(
        tmp_path, "--rows", "reads", "--read-entries", str(ENTRIES), "--read-page", str(PAGE)
    )
    rows = table_rows(result.stdout)
    assert tuple(rows["run"]) == READ_HEADER, result.stdout
    shape = read_shape(ENTRIES, PAGE)
    expected = {f"{shape}, {how}, {copies}" for how in HOW for copies in COPIES}
    assert {name for name in rows if not name.startswith("-")} - {"run"} == expected, (
        result.stdout  # no append row: --rows reads
    )
    for name in expected:
        _, entries_per_s, _, p50, p99, misread, *cores = rows[name]
        assert number(entries_per_s) > 0 and misread == "0", (name, result.stdout)
        assert 0 < number(p50) <= number(p99), (name, result.stdout)
        assert len(cores) == len(PROCESSES) and all(number(c) >= 0 for c in cores)
    ratios = {(m[1], m[2]): m for m in READ_RATIO.finditer(result.stdout)}
    assert set(ratios) == {(shape, copies) for copies in COPIES}, result.stdout
    assert all(float(m[3]) > 0 and float(m[4]) == READ_TARGET for m in ratios.values())


async def _pages(pages: list[list[tuple[int, bytes]]]) -> AsyncIterator[list[tuple[int, bytes]]]:
    for page in pages:
        yield page


def _read(pages: list[list[tuple[int, bytes]]], expected: int) -> Row:
    row = Row(f"{read_shape(expected, 2)}, {HOW[1]}, {COPIES[1]}", REPLICATED, expected=expected)
    return run(_timed_read(row, _pages(pages), {}))


def test_a_read_of_other_entries_than_the_ones_written_fails_the_bench() -> None:
    good = [(i, indexed_payload(i)) for i in range(6)]
    row = _read([good[0:2], good[2:4], good[4:6]], 6)
    assert (row.entries, row.misread, len(row.latencies)) == (6, 0, 3)
    assert read_failures([row]) == [] and row.seconds > 0
    swapped = [(2, good[3][1]), (3, good[2][1])]  # right ids, each the other's payload
    assert _read([good[0:2], swapped, good[4:6]], 6).misread == 2
    skipped = [good[0], good[2]]  # entry 1 missing: every page after it is off by one
    assert _read([skipped, good[3:6]], 6).misread == 5
    cut = [good[0], (1, good[1][1][:-1])]
    failed = _read([cut, good[2:6]], 6)
    assert read_failures([failed]) == [f"{failed.name}: 1 entries read are not the ones written"]
    short = _read([good[0:2]], 6)
    assert read_failures([short]) == [f"{short.name}: read 2 entries of the 6"]
    assert read_ratio_lines([row]) == []  # no range read to compare with
