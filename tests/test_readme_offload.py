"""The README's offload example runs as written against a fresh node and offloads the ledger
it made (issue 28, item 8: it offloaded ledger 12, which a fresh node does not have, and
got 200 ``skipped: not_found``); the files the walkthroughs leave are ignored by git."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.crash.nodeproc import NodeProcess
from tests.hostdisk import REPO
from tests.test_readme import BLOCK_TIMEOUT_S, FENCED_SH, README, README_ADDRESS, _sections

OFFLOAD_SECTION = "Offload (tiered storage)"


def _offload_example() -> str:
    blocks = FENCED_SH.findall(_sections(README.read_text())[OFFLOAD_SECTION])
    found = [b for b in blocks if "/api/v1/offload/run" in b and "serve" not in b]
    assert len(found) == 1, blocks
    return str(found[0])


@pytest.mark.skipif(shutil.which("curl") is None, reason="the README's example uses curl")
def test_the_offload_example_offloads_the_ledger_it_made(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "data")
    node.start()
    try:
        script = _offload_example().replace(README_ADDRESS, f"127.0.0.1:{node.port}")
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
            check=False,
        )
    finally:
        assert node.terminate() == 0
    assert done.returncode == 0, done.stderr
    assert "not_found" not in done.stdout
    assert '"state": "offloaded"' in done.stdout.splitlines()[-1], done.stdout


def test_what_the_walkthroughs_leave_behind_is_ignored_by_git(tmp_path: Path) -> None:
    left = ["payload.bin", "frames.bin", "audit-out/summary.json"]
    checked = subprocess.run(
        ["git", "check-ignore", "--no-index", *left],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert sorted(checked.stdout.split()) == sorted(left), checked
