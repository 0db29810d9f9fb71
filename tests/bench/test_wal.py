"""``python -m node bench wal`` end to end: a short run on the default media (a loop device
made for the run and a plain file) prints the WAL's rows and fio's, with ratios."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from tests.harness.hostdisk import run_bench

RUN_TIMEOUT_S = 240  # the run takes some seconds; this only stops a hang
FIGURE = r"\s*([\d,.]+)\s*"


def test_bench_wal_prints_wal_and_fio_figures_for_both_media(tmp_path: Path) -> None:
    assert shutil.which("fio"), "fio is not installed: `make test` installs it (apt-get)"
    scratch = tmp_path / "bench"
    result = run_bench(
        "wal",
        "--seconds",
        "0.3",
        "--record-sizes",
        "262144",
        "--writers",
        "16",
        "--dir",
        str(scratch),
        timeout_s=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"### loop device /dev/loop\d+ over ", out), out
    assert "### file " in out, out
    for row in ("wal unthrottled", r"wal at target \(500/s\)", "wal 4 KiB blocks"):
        found = re.findall(rf"\| {row}\s*\|{FIGURE}\|{FIGURE}\|{FIGURE}\|{FIGURE}\|", out)
        assert len(found) == 2, f"{row}: {found}\n{out}"  # one per medium
        for figures in found:
            assert all(float(f.replace(",", "")) > 0 for f in figures), (row, figures)
    assert len(re.findall(r"\| fio bs=260k QD4 dsync", out)) == 2, out
    assert len(re.findall(r"\| fio bs=4k QD4 dsync", out)) == 2, out
    median = r": median of 6 rounds \d+\.\d\d \(.*; pooled \d+\.\d\d; by round: "
    assert len(re.findall(rf"wal/fio bandwidth .*{median}", out)) == 2, out
    assert len(re.findall(rf"wal/fio writes/s at 4 KiB blocks, QD4{median}", out)) == 2
    assert "### summary" in out
    # It cleans up after itself: nothing left of what it created, no loop device attached.
    assert not scratch.exists() or not any(scratch.iterdir())
    attached = subprocess.run(["losetup", "--list"], capture_output=True, text=True, check=False)
    assert str(scratch) not in attached.stdout
