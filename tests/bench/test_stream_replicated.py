"""`python -m node bench stream --replicated`: end to end on a real local cluster (etcd and four
node processes) and a single node, one run for the append rows and one for the read and tail
rows (``--rows``): every row with positive figures, no errors, every entry read the one
written; the ratio lines with their targets; the scratch directory gone. Then the read load
process against a real node whose stream holds other entries than the ones it expects (it
must count them), and the ratio lines' arithmetic and verdicts on figures made up for them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from node.bench.common import MB, UsageError
from node.bench.server import (
    ENTRY_SIZE,
    LoadFailed,
    call,
    indexed_payload,
    load_process,
    misread,
    serving,
)
from node.bench.stream import POLICIES, TAIL_RATE
from node.bench.stream_reads import CURSOR, PLAIN
from node.bench.stream_replicated import (
    BATCH_TARGET,
    CATCH_UP_TARGET,
    CONSUMER_ELSEWHERE,
    FLEET_SIDE,
    FLEET_TARGET,
    FORWARD_TARGET,
    FORWARDED,
    GROUPS,
    ONE_TARGET,
    OTHER_SIDE,
    OWNER_SIDE,
    READ_MODULE,
    REPLICATED,
    SINGLE_NODE,
    SINGLE_TARGET,
    TAIL_TARGET,
    Row,
    append_table,
    catch_up_shape,
    parse_groups,
    ratio_lines,
    tail_shape,
    targets,
)
from node.wire import BATCH_CONTENT_TYPE, JSON_CONTENT_TYPE, encode_batch
from tests.harness.hostdisk import HOST_DISK_NEUTRAL, as_env, number, run_bench, table_rows

RUN_TIMEOUT_S = 300  # a node's and a cluster's start and short runs; this only stops a hang
WRITERS = 2
ENTRIES, PAGE = 600, 250  # three pages, the last one short
MB_ROUNDING = 0.06  # MB/s printed to 0.1, entries/s to 1
SHAPES = (
    f"batch appends (100 x 1 KiB), {WRITERS} writers",
    f"single appends, {WRITERS} writers",
    "one append at a time",
)
CPU = ("server cores", "owner cores", "other nodes cores", "etcd cores")
APPEND_HEADER = ("run", "requests/s", "entries/s", "MB/s", "p50 ms", "p99 ms", "errors", *CPU)
READ_HEADER = (
    "run",
    "entries read",
    "misread",
    "entries/s",
    "MB/s",
    "page p50 ms",
    "page p99 ms",
    *CPU,
)
TAIL_HEADER = (
    "run",
    "appends/s",
    "append p50 ms",
    "end-to-end p50 ms",
    "end-to-end p99 ms",
    "received / appended",
    "misread",
    *CPU,
)
TARGET_LINE = re.compile(
    r"^- (.+): (.+) / (.+?) (entries/s|p50|end-to-end p50) = ([\d.]+)x "
    r"\(target (>=|<=) ([\d.]+)x: (met|MISSED)\)$",
    re.MULTILINE,
)


def _bench(tmp_path: Path, *rows: str) -> tuple[str, Path]:
    scratch = tmp_path / "bench"
    result = run_bench(
        "stream",
        "--replicated",
        *rows,
        "--seconds",
        "0.5",
        "--writers",
        str(WRITERS),
        "--read-entries",
        str(ENTRIES),
        "--read-page",
        str(PAGE),
        "--dir",
        str(scratch),
        timeout_s=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout, result.stdout
    assert not scratch.exists() or not any(scratch.iterdir())  # the cluster's data is gone
    return result.stdout, scratch


def _mb_agrees(mb_per_s: str, entries_per_s: str) -> bool:
    """The MB/s cell is the entries/s of 1 KiB (both rounded: a slow row shows 0.0)."""
    return abs(number(mb_per_s) - number(entries_per_s) * ENTRY_SIZE / MB) <= MB_ROUNDING


def _headers(out: str) -> list[tuple[str, ...]]:
    return [
        tuple(cell.strip() for cell in line.strip().strip("|").split("|"))
        for line in out.splitlines()
        if line.startswith("| run ")
    ]


def _targets(out: str) -> dict[tuple[str, str], tuple[str, float, str, float]]:
    """(shape, side) -> (figure, ratio, op, target) of the ratio lines."""
    return {(m[1], m[2]): (m[4], float(m[5]), m[6], float(m[7])) for m in TARGET_LINE.finditer(out)}


def _cpu_cells(name: str, cells: list[str], out: str) -> None:
    server, owner, others, etcd = cells
    assert number(server) >= 0 and number(owner) >= 0, (name, out)
    if name.endswith(SINGLE_NODE):  # one process: no other node, no etcd
        assert (others, etcd) == ("-", "-"), (name, out)
    else:
        assert number(others) >= 0 and number(etcd) >= 0, (name, out)
        total = number(owner) + number(others) + number(etcd)
        assert abs(total - number(server)) <= 0.03, (name, out)  # the parts add up (rounding)


def test_append_rows_on_both_sides_and_the_forwarded_append(tmp_path: Path) -> None:
    out, _ = _bench(tmp_path, "--rows", "appends")
    rows = table_rows(out)
    assert _headers(out) == [APPEND_HEADER], out
    expected = {f"{shape}, {side}" for shape in SHAPES for side in (SINGLE_NODE, REPLICATED)}
    expected.add(f"one append at a time, {FORWARDED}")
    assert {name for name in rows if not name.startswith("-")} - {"run"} == expected, out
    for name in expected:
        _, requests_per_s, entries_per_s, mb_per_s, p50, p99, errors, *cpu = rows[name]
        assert number(requests_per_s) > 0 and number(entries_per_s) > 0, (name, out)
        assert _mb_agrees(mb_per_s, entries_per_s), (name, out)
        assert 0 < number(p50) <= number(p99), (name, out)
        assert errors == "0", (name, out)
        assert number(cpu[0]) > 0, (name, out)
        _cpu_cells(name, cpu, out)
    assert not any(line.startswith("| catch-up") for line in out.splitlines()), out
    found = _targets(out)
    batch, single, one = SHAPES
    assert found.keys() == {
        (batch, REPLICATED),
        (single, REPLICATED),
        (one, REPLICATED),
        (one, FORWARDED),
    }, out
    assert found[(batch, REPLICATED)][::2] == ("entries/s", ">=")
    assert found[(batch, REPLICATED)][3] == BATCH_TARGET
    assert found[(single, REPLICATED)][3] == SINGLE_TARGET
    assert found[(one, REPLICATED)][0::2] == ("p50", "<=") and found[(one, REPLICATED)][3] == 2.0
    assert found[(one, FORWARDED)][3] == FORWARD_TARGET
    assert all(ratio > 0 for _, ratio, _, _ in found.values()), out


def test_read_and_tail_rows_read_every_entry_written(tmp_path: Path) -> None:
    out, _ = _bench(tmp_path, "--rows", "reads,tail")
    rows = table_rows(out)
    plain, cursor = catch_up_shape(ENTRIES, PAGE), catch_up_shape(ENTRIES, PAGE, cursor=True)
    reads = [f"{plain}, {side}" for side in (SINGLE_NODE, OWNER_SIDE, OTHER_SIDE, FLEET_SIDE)]
    reads += [f"{cursor}, {side}" for side in (SINGLE_NODE, OWNER_SIDE)]
    tails = [f"{tail_shape()}, {side}" for side in (SINGLE_NODE, OWNER_SIDE, CONSUMER_ELSEWHERE)]
    assert {name for name in rows if not name.startswith("-")} == {
        "run",
        *reads,
        *tails,
    }, out  # no append row: --rows picked these groups only
    assert _headers(out) == [READ_HEADER, TAIL_HEADER], out
    for name in reads:
        _, read, wrong, per_s, mb_per_s, p50, p99, *cpu = rows[name]
        assert number(read) == ENTRIES and wrong == "0", (name, out)
        assert number(per_s) > 0 and _mb_agrees(mb_per_s, per_s), (name, out)
        assert 0 < number(p50) <= number(p99), (name, out)
        _cpu_cells(name, cpu, out)
    for name in tails:
        _, per_s, append_p50, e2e_p50, e2e_p99, received, wrong, *cpu = rows[name]
        assert 0 < number(per_s) <= TAIL_RATE * 1.1, (name, out)  # paced, not flat out
        assert number(append_p50) > 0, (name, out)
        assert 0 < number(e2e_p50) <= number(e2e_p99), (name, out)
        got, appended = (number(n) for n in received.split(" / "))
        assert got == appended > 0 and wrong == "0", (name, out)
        _cpu_cells(name, cpu, out)
    found = _targets(out)
    assert found.keys() == {
        (plain, OWNER_SIDE),
        (plain, OTHER_SIDE),
        (plain, FLEET_SIDE),
        (cursor, OWNER_SIDE),
        (tail_shape(), OWNER_SIDE),
        (tail_shape(), CONSUMER_ELSEWHERE),
    }, out
    assert found[(plain, OWNER_SIDE)][::2] == ("entries/s", ">=")
    assert found[(plain, OTHER_SIDE)][3] == found[(cursor, OWNER_SIDE)][3] == CATCH_UP_TARGET
    assert found[(plain, FLEET_SIDE)][3] == FLEET_TARGET
    assert found[(tail_shape(), OWNER_SIDE)][::2] == ("end-to-end p50", "<=")
    assert found[(tail_shape(), OWNER_SIDE)][3] == TAIL_TARGET
    assert all(ratio > 0 for _, ratio, _, _ in found.values()), out


def test_the_read_load_counts_entries_that_are_not_the_ones_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream of 30 entries where entry 7 is entry 8's payload and entry 8 entry 7's, and
    entry 20 is one byte short: the catch-up read finds these three, plain and by a cursor."""
    for name, value in as_env(HOST_DISK_NEUTRAL).items():
        monkeypatch.setenv(name, value)  # the node below, as run_bench starts one
    payloads = [indexed_payload(i) for i in range(30)]
    payloads[7], payloads[8] = payloads[8], payloads[7]
    payloads[20] = payloads[20][:-1]
    with serving(tmp_path / "node") as server:
        call(
            f"{server.url}/api/v1/streams/s",
            "PUT",
            json.dumps(POLICIES).encode(),
            JSON_CONTENT_TYPE,
        )
        call(
            f"{server.url}/api/v1/streams/s/entries",
            "POST",
            encode_batch(payloads),
            BATCH_CONTENT_TYPE,
        )
        pid = str(server.proc.pid)
        for mode in (PLAIN, CURSOR):
            result = load_process(READ_MODULE, server.url, "s", mode, 30, 8, pid)
            assert (result["entries"], result["misread"], result["requests"]) == (30, 3, 4)
        # Asked for more than the stream holds: it reports what it got (the bench fails on it).
        result = load_process(READ_MODULE, server.url, "s", PLAIN, 40, 8, pid)
        assert result["entries"] == 30
        try:
            load_process(READ_MODULE, server.url, "missing", PLAIN, 30, 8, pid)
        except LoadFailed as error:
            assert "404" in str(error)
        else:
            raise AssertionError("a read of a missing stream did not fail the load")


def test_misread_and_row_failures() -> None:
    good = [indexed_payload(i) for i in range(5, 9)]
    assert misread(5, good) == 0
    assert misread(4, good) == 4  # shifted by one: every entry is another's
    assert misread(5, [*good[:3], good[3][:-1]]) == 1  # cut
    assert misread(5, [*good[:3], bytes(ENTRY_SIZE)]) == 1
    assert len(set(good)) == len(good) and all(len(p) == ENTRY_SIZE for p in good)
    ok = Row(name="r", requests=1, entries=10, seconds=1.0, latencies=[0.1], expected=10)
    assert ok.failure() is None
    ok.misread = 1
    assert ok.failure() == "r: 1 entries read are not the ones written there"
    short = Row(name="r", requests=1, entries=9, seconds=1.0, latencies=[0.1], expected=10)
    assert short.failure() == "r: read 9 entries of the 10 written"
    lost = Row(name="t", requests=1, entries=1, seconds=1.0, latencies=[0.1], appended=5)
    lost.delivered = 4
    assert lost.failure() == "t: received 4 of the 5 appended"


def test_rows_picks_groups() -> None:
    assert parse_groups(None, GROUPS) == list(GROUPS)
    assert parse_groups("tail,reads", GROUPS) == ["reads", "tail"]  # run order
    for bad in ("", "reads,writes", ","):
        try:
            parse_groups(bad, GROUPS)
        except UsageError as error:
            assert "--rows takes some of appends, reads, tail" in str(error)
        else:
            raise AssertionError(f"--rows {bad!r} was taken")


def row(name: str, entries: int, p50_s: float, e2e: float = 0.0) -> Row:
    return Row(
        name=name,
        requests=entries,
        entries=entries,
        seconds=1.0,
        latencies=[p50_s],
        e2e=[e2e] if e2e else [],
    )


def test_ratio_lines_compare_each_target_and_the_forwarded_append() -> None:
    batch, single, one = SHAPES
    plain = catch_up_shape(100, 10)
    tail = tail_shape()
    rows = [
        row(f"{batch}, {SINGLE_NODE}", 1000, 0.010),
        row(f"{batch}, {REPLICATED}", 250, 0.020),
        row(f"{single}, {SINGLE_NODE}", 100, 0.010),
        row(f"{single}, {REPLICATED}", 30, 0.010),
        row(f"{one}, {SINGLE_NODE}", 100, 0.001),
        row(f"{one}, {REPLICATED}", 50, 0.002),
        row(f"{one}, {FORWARDED}", 40, 0.004),
        row(f"{plain}, {SINGLE_NODE}", 1000, 0.1),
        row(f"{plain}, {OWNER_SIDE}", 800, 0.1),
        row(f"{plain}, {FLEET_SIDE}", 800, 0.1),
        row(f"{tail}, {SINGLE_NODE}", 100, 0.001, e2e=0.002),
        row(f"{tail}, {OWNER_SIDE}", 100, 0.001, e2e=0.004),
    ]
    assert ratio_lines(rows, targets(WRITERS, 100, 10)) == [
        f"- {batch}: {REPLICATED} / {SINGLE_NODE} entries/s = 0.25x (target >= 0.3x: MISSED)",
        f"- {single}: {REPLICATED} / {SINGLE_NODE} entries/s = 0.30x (target >= 0.3x: met)",
        f"- {one}: {REPLICATED} / {SINGLE_NODE} p50 = 2.00x (target <= {ONE_TARGET}x: met)",
        f"- {one}: {FORWARDED} / {REPLICATED} p50 = 2.00x (target <= 1.5x: MISSED)",
        f"- {plain}: {OWNER_SIDE} / {SINGLE_NODE} entries/s = 0.80x (target >= 0.8x: met)",
        f"- {plain}: {FLEET_SIDE} / {SINGLE_NODE} entries/s = 0.80x (target >= 0.9x: MISSED)",
        f"- {tail}: {OWNER_SIDE} / {SINGLE_NODE} end-to-end p50 = 2.00x (target <= 1.5x: MISSED)",
    ]
    assert ratio_lines(rows[:1] + rows[2:3], targets(WRITERS, 100, 10)) == []  # one side only
    cells = table_rows("\n".join(append_table(rows)))
    assert cells[f"{one}, {FORWARDED}"][1:] == ["40", "40", "0.0", "4.00", "4.00", "0"] + ["-"] * 4
