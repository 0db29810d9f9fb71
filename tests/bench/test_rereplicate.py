"""`python -m node bench rereplicate` end to end, on a real local cluster (etcd and four node
processes, one of them killed and wiped by the bench): a short run prints both rows with
positive figures, the same bytes copied by each, and the ratio line with its target; its
scratch directory (cluster data included) is gone."""

from __future__ import annotations

import re
from pathlib import Path

from tests.harness.hostdisk import number, run_bench, table_rows

RUN_TIMEOUT_S = 300  # a cluster's start, 2 MiB written and copied twice; this only stops a hang
HEADER = ("run", "fragments", "entries", "MB", "s", "fragments/s", "entries/s", "MB/s")
BASELINE = "client reads + adds, 4 ledgers at a time"
REREPLICATION = "re-replication (nodes' route), 4 markers at a time"
RATIO = re.compile(
    r"^- re-replication / client reads \+ adds MB/s = ([\d.]+)x \(target >= 0\.3x: (met|MISSED)\)",
    re.MULTILINE,
)


def test_bench_rereplicate_prints_both_copies_of_the_same_bytes(tmp_path: Path) -> None:
    scratch = tmp_path / "bench"
    result = run_bench(
        "rereplicate", "--rereplicate-mib", "2", "--entry-size", "4096", "--dir", str(scratch),
        timeout_s=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = table_rows(result.stdout)
    assert tuple(rows["run"]) == HEADER, result.stdout
    copied = []
    for name in (BASELINE, REREPLICATION):
        _, fragments, entries, mb, seconds, *rates = rows[name]
        # 2 MiB of 4 KiB entries: one ledger of 512, on the lost node (the one in most).
        assert (fragments, entries) == ("1", "512"), (name, result.stdout)
        assert number(mb) > 0 and number(seconds) > 0, (name, result.stdout)
        assert all(number(rate) > 0 for rate in rates), (name, result.stdout)
        copied.append(mb)
    assert copied[0] == copied[1], result.stdout  # the same bytes
    ratio = RATIO.search(result.stdout)
    assert ratio is not None and float(ratio[1]) > 0, result.stdout
    assert not scratch.exists() or not any(scratch.iterdir())  # the cluster's data is gone
