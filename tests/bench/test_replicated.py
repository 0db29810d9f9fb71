"""`python -m node bench replicated` end to end, on a real local cluster (etcd and three node
processes): a short run prints every row with positive figures, the CPU of every process, and
a ratio line per pair with its target; its scratch directory (cluster data included) is gone."""

from __future__ import annotations

import re
from pathlib import Path

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


def test_bench_replicated_prints_both_copies_for_every_shape(tmp_path: Path) -> None:
    scratch = tmp_path / "bench"
    result = run_bench(
        "replicated",
        "--seconds",
        "0.5",
        "--writers",
        str(WRITERS),
        "--window",
        str(WINDOW),
        "--dir",
        str(scratch),
        timeout_s=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = table_rows(result.stdout)
    assert tuple(rows["run"]) == HEADER, result.stdout
    expected = {f"{shape}, {copies}" for shape in SHAPES for copies in COPIES}
    assert set(rows) - {"run", "---"} >= expected, result.stdout
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
    assert not scratch.exists() or not any(scratch.iterdir())  # the cluster's data is gone
