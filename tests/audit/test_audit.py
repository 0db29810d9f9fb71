"""The audit on real node data: a clean copy and one copy per injected fault, audited
together as a fleet (one snapshot per copy) in one Spark job, so that each check is seen to
find exactly its fault, on its node only, and nothing on the clean one. One local[2]
session serves the module; the job also runs once through spark-submit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from node.audit import CHECKS, FLEET_CHECKS, job, ranges, snapshot, source
from node.storage import entrylog, logformat
from tests.audit import world as w
from tests.harness.spark import spark_env

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
# These copies are of a node without a metadata store: no replicated ledger, no metadata for
# the replicas check (tests/audit/test_replicas.py), which therefore does not run.
NODE_CHECKS = [c for c in CHECKS if c not in FLEET_CHECKS]
SPLIT_BYTES = 32 * 1024  # two tasks per 64 KiB log: the second starts mid-record
VENV_BIN = Path(sys.executable).parent
WHOLE_LOG_BYTES = 1 << 30  # one range per (64 KiB) log


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> w.World:
    return w.build(tmp_path_factory.mktemp("base") / "data")


@pytest.fixture(scope="module")
def fleet(
    base: w.World, spark: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """Every copy, its fault applied; the audit's summary; and what each fault expects
    (check -> set of (ledger, entry) or (ledger, log))."""
    root = tmp_path_factory.mktemp("fleet")
    a, b, c = base.plain
    expected: dict[str, Any] = {"clean": {}}
    copies = {name: w.copy(base, root / name) for name in w.FAULTS}
    copies["clean"] = w.copy(base, root / "clean")
    w.flip_payload_byte(copies["flip"], a, 3)
    expected["flip"] = {"crc": {(a, 3)}}
    w.delete_index_entry(copies["unindexed"], b, 5)
    expected["unindexed"] = {"unindexed": {(b, 5)}}
    w.move_index_entry(copies["moved"], c, 2, 7)
    expected["moved"] = {"index": {(c, 2)}}
    w.orphan_record(copies["orphan"], a, 9)
    expected["orphan"] = {"garbage": {(a, 9)}}
    old_log = w.age_first_log(copies["pinned"])
    expected["pinned"] = {"pinned": {(base.pin, None)}}
    left = w.leave_ledger_out_of_retention(copies["retention"])
    expected["retention"] = {"retention": {(left, None)}}
    w.tamper_offloaded_object(copies["offload"])
    expected["offload"] = {"offload": {(base.offloaded, None)}}
    missing = w.hole_below_lac(copies["hole"], b)
    expected["hole"] = {"holes": {(b, e) for e in missing}}
    uris = []
    for name, copy in copies.items():
        snap = snapshot.from_data_dir(copy.data_dir, node=name)
        uris.append(snapshot.write_dir(snap, root / "snapshots" / name))
    out = root / "out"
    args = job.build_parser().parse_args(
        [
            "--out",
            str(out),
            "--split-bytes",
            str(SPLIT_BYTES),
            *[part for u in uris for part in ("--snapshot", u)],
        ]
    )
    status = job.run(args, spark)
    summary = w.read_json(out / job.SUMMARY_FILE)
    summary["exit"] = status
    summary["oldLog"] = old_log
    return summary, expected, out


def found(out: Path, check: str) -> dict[str, set[tuple[int, int | None]]]:
    rows = pq.read_table(out / f"{check}.parquet").to_pylist()
    by_node: dict[str, set[tuple[int, int | None]]] = {}
    for row in rows:
        by_node.setdefault(row["node"], set()).add((row["ledger_id"], row["entry_id"]))
    return by_node


@pytest.mark.parametrize("node", ["clean", *w.FAULTS])
def test_each_check_finds_exactly_its_fault(
    fleet: tuple[dict[str, Any], dict[str, Any], Path], node: str
) -> None:
    _summary, expected, out = fleet
    for check in NODE_CHECKS:
        assert found(out, check).get(node, set()) == expected[node].get(check, set()), check


def test_summary_counts_and_exit_status(fleet: tuple[dict[str, Any], dict[str, Any], Path]) -> None:
    summary, expected, _out = fleet
    assert summary["exit"] == job.EXIT_VIOLATIONS
    assert summary["status"] == "violations"
    assert sorted(summary["checks"]) == sorted(NODE_CHECKS)  # replicas: no metadata given
    assert "replicas" not in summary
    for check in NODE_CHECKS:
        want = sum(len(e.get(check, ())) for e in expected.values())
        assert summary["checks"][check]["violations"] == want, check
    # GC's view: the orphan copy is bytes GC counts live that nothing references
    assert summary["garbage"]["gcLiveBytes"] > summary["garbage"]["referencedBytes"]
    assert summary["logAges"][">=90d"] == 0 and summary["logAges"]["<90d"] == 1


def test_clean_data_exits_zero_and_bad_input_exits_two(
    base: w.World, spark: Any, tmp_path: Path
) -> None:
    args = job.build_parser().parse_args(
        ["--data-dir", str(base.data_dir), "--out", str(tmp_path / "out"), "--checks", "index,crc"]
    )
    assert job.run(args, spark) == job.EXIT_CLEAN
    assert w.read_json(tmp_path / "out" / job.SUMMARY_FILE)["status"] == "clean"
    missing = job.build_parser().parse_args(
        ["--data-dir", str(tmp_path / "nothing"), "--out", str(tmp_path / "out2")]
    )
    assert job.run(missing, spark) == job.EXIT_CANNOT_RUN
    unknown = job.build_parser().parse_args(
        ["--data-dir", str(base.data_dir), "--out", str(tmp_path / "o3"), "--checks", "nope"]
    )
    assert job.run(unknown, spark) == job.EXIT_CANNOT_RUN
    no_metadata = job.build_parser().parse_args(
        ["--data-dir", str(base.data_dir), "--out", str(tmp_path / "o4"), "--checks", "replicas"]
    )
    assert job.run(no_metadata, spark) == job.EXIT_CANNOT_RUN


def test_spark_submit_runs_the_same_job(base: w.World, tmp_path: Path) -> None:
    faulty = w.copy(base, tmp_path / "data")
    w.flip_payload_byte(faulty, base.plain[0], 1)
    out = tmp_path / "out"
    env = spark_env(PYTHONPATH=str(REPO))
    result = subprocess.run(
        [
            str(VENV_BIN / "spark-submit"),
            "--master",
            "local[2]",
            "--conf",
            "spark.ui.enabled=false",
            str(REPO / "node" / "audit" / "job.py"),
            "--data-dir",
            str(faulty.data_dir),
            "--out",
            str(out),
            "--checks",
            "crc,index",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == job.EXIT_VIOLATIONS, result.stderr[-3000:]
    summary = w.read_json(out / job.SUMMARY_FILE)
    assert summary["checks"]["crc"]["violations"] == 1
    assert summary["checks"]["index"]["violations"] == 0
    assert "crc    1" in result.stdout.splitlines()


def test_spark_runs_one_task_per_planned_range_and_they_agree_with_whole_logs(
    base: w.World, spark: Any
) -> None:
    """Spark honours the Data Source's partitions (its options are case-insensitive: a lost
    splitBytes once made every log one task), and ranges that start mid-record find the
    same records as one range per log."""
    ledgers_dir = base.data_dir / "ledgers"
    logs = [
        ("n", str(ledgers_dir), i, logformat.log_path(ledgers_dir, i).stat().st_size)
        for i in entrylog.list_logs(ledgers_dir)
    ]
    planned = sum(len(ranges.plan_ranges(size, SPLIT_BYTES)) for *_, size in logs)
    assert planned > len(logs)
    split = source.read_records(spark, logs, SPLIT_BYTES)
    assert split.rdd.getNumPartitions() == planned
    whole = source.read_records(spark, logs, WHOLE_LOG_BYTES)
    assert whole.rdd.getNumPartitions() == len(logs)
    columns = ("log_id", "offset", "ledger_id", "entry_id", "size", "crc_ok", "crc")
    assert sorted(split.select(*columns).collect()) == sorted(whole.select(*columns).collect())
