"""`python -m node bench jepsen` end to end: two short seeded fault runs against a real local
cluster print a line per run and the summary (readers' reads included), and a clean verdict
exits 0."""

from __future__ import annotations

from pathlib import Path

from tests.harness.hostdisk import run_bench

RUN_TIMEOUT_S = 240.0  # bounds a hang only


def test_bench_jepsen_runs_seeded_fault_runs_and_prints_the_verdict(tmp_path: Path) -> None:
    result = run_bench(
        "jepsen",
        "--runs",
        "2",
        "--seed",
        "7",
        "--seconds",
        "1",
        "--dir",
        str(tmp_path),
        timeout_s=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("run ")] == ["1/2", "2/2"]
    assert "runs: 2" in lines
    assert "clean: 2" in lines
    assert any(line.startswith("operations ok: ") for line in lines)
    [reads] = [line for line in lines if line.startswith("reads: ")]
    counts = dict(part.rsplit(" ", 1) for part in reads.removeprefix("reads: ").split(", "))
    assert int(counts["reads_ok"]) > 0 and int(counts["read_entries"]) > 0, reads
    assert not (tmp_path / "seed-7").exists(), "a clean run's files are removed"


def test_bench_jepsen_refuses_zero_runs() -> None:
    result = run_bench("jepsen", "--runs", "0", timeout_s=RUN_TIMEOUT_S)
    assert result.returncode == 2
    assert "--runs" in result.stderr
