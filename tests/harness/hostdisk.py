"""Tests that are not about disk space must not depend on how full the machine's disk is.

CI machines have run at 80-95% disk usage: with the default watermarks a test node there
forces GC, deletes stream ledgers for reason "disk", or turns read-only. These settings put
every watermark where usage cannot pass it and make no emergency reserve; the disk tests
(tests/lifecycle/test_full_disk.py, a small loop-mounted file system) set their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HOST_DISK_NEUTRAL: dict[str, Any] = {
    "gc_disk_usage_threshold": 1.0,
    "disk_usage_warn_threshold": 1.0,
    "disk_usage_threshold": 1.0,
    "disk_usage_lwm_threshold": 1.0,
    "disk_max_used_space_ratio": 1.0,
    "disk_space_clean_forcibly_ratio": 1.0,
    "disk_emergency_reserve_bytes": 0,
}


def as_env(settings: dict[str, Any]) -> dict[str, str]:
    """The same settings as the node process's NODE_* variables."""
    return {f"NODE_{name.upper()}": str(value) for name, value in settings.items()}


def neutral_env() -> dict[str, str]:
    """This process's environment with the settings above, for a node or bench subprocess."""
    return {**os.environ, **as_env(HOST_DISK_NEUTRAL)}


REPO = Path(__file__).resolve().parents[2]


def run_bench(
    *args: str, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m node bench ARGS`` from the repository, on a host-disk-neutral node, with
    ``env`` added. ``timeout_s`` only stops a hang; it asserts nothing about speed."""
    return run_node("bench", *args, timeout_s=timeout_s, env=env)


def run_node(
    *args: str, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m node ARGS`` from the repository, host-disk-neutral, to its end."""
    return subprocess.run(
        [sys.executable, "-m", "node", *args],
        env={**neutral_env(), **(env or {})},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def table_rows(output: str) -> dict[str, list[str]]:
    """The rows of the Markdown tables a bench prints, by their first cell."""
    rows = {}
    for line in output.splitlines():
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells
    return rows


def number(cell: str) -> float:
    """A figure of a bench table (thousands separated by commas)."""
    return float(cell.replace(",", ""))
