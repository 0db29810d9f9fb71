"""`python -m node bench audit --http` end to end on a tiny data set: the table has a row per
scan (over HTTP from a node too, without and with its pace), every scan found every record
and no bad CRC, Spark ran as many partitions as the Data Source planned, and adds were
measured beside the scans over HTTP, the CPU per GB of each way printed. Nothing about
speed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness.hostdisk import run_bench, table_rows
from tests.harness.spark import quick_jvm_env

RUN_TIMEOUT_S = 600  # three Spark sessions, two nodes start: this only stops a hang
pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 60)
SCANS = (
    "spark local[1]",
    "spark local[2]",
    "inspect (1 thread)",
    "spark local[2] over HTTP, no cap",
    "spark local[2] over HTTP, cap 34 MB/s",  # the default pace, 32 MiB/s
)
GIB = "0.004"  # about 4 MiB of logs
SPLIT_MIB = "0.5"  # several partitions in one log
RECORDS_COLUMN = 4
BAD_CRC_COLUMN = 5
PARTITIONS_COLUMN = 6


def test_bench_audit_prints_the_scans_side_by_side(tmp_path: Path) -> None:
    result = run_bench(
        "audit",
        "--gib",
        GIB,
        "--split-mib",
        SPLIT_MIB,
        "--dir",
        str(tmp_path / "bench"),
        "--http",
        "--rounds",
        "1",
        timeout_s=RUN_TIMEOUT_S,
        env=quick_jvm_env(),  # the JVMs' speed is not what this checks
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = table_rows(result.stdout)
    assert set(SCANS) <= set(rows), result.stdout
    records = {rows[s][RECORDS_COLUMN] for s in SCANS}
    assert len(records) == 1 and int(records.pop()) > 0  # the same records every way
    assert all(rows[s][BAD_CRC_COLUMN] == "0" for s in SCANS)
    for scan in SCANS[:2]:
        planned, _, reported = rows[scan][PARTITIONS_COLUMN].partition(" planned, ")
        assert int(planned) > 1 and reported == f"{planned} in Spark", rows[scan]
    assert "local[2] / local[1]: " in result.stdout
    assert "over HTTP / local files (local[2]): " in result.stdout
    [cpu] = [line for line in result.stdout.splitlines() if line.startswith("CPU s per GB")]
    local, http, node = (float(x) for x in re.findall(r"\d+\.\d+", cpu))
    assert local > 0 and http > node > 0, cpu  # the node's CPU counted in the HTTP scan's
    for pace in ("no cap", "cap 34 MB/s"):
        assert int(rows[pace][4]) > 0, rows[pace]  # adds completed during the scan
    assert not (tmp_path / "bench").exists() or not any((tmp_path / "bench").iterdir())
