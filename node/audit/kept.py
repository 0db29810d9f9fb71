"""The node's own audit snapshots on its disk (POST /api/v1/audit/snapshot): which there
are, the older ones deleted, the bytes they take. No pyarrow: the metrics and the disk
monitor import it."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

META_FILE = "snapshot.json"  # a snapshot's description, written last
LEDGERS_FILE = "ledgers.json"  # a replicated node's: the store's ledgers (node.audit.fleet)
LOGS_DIR = "logs"  # in a live node's snapshot directory: hard links to the logs it lists
PARQUET_SUFFIX = ".parquet"  # a snapshot's table is the file <name>.parquet
# The snapshot's tables by name; node.audit.tables gives their Arrow schemas (pyarrow, which
# a node that serves no snapshot never imports).
TABLES = ("locations", "ledgers", "logs", "log_ledgers", "streams", "cursors", "doomed")


def read_meta(directory: Path) -> dict[str, Any]:
    return cast(dict[str, Any], json.loads((directory / META_FILE).read_text()))


@dataclass(frozen=True, slots=True)
class Kept:
    """A snapshot directory under the node's snapshot directory."""

    path: Path
    taken_ms: int  # 0 for one left incomplete (no snapshot.json): the first to go


def list_kept(root: Path) -> list[Kept]:
    """Blocking. The snapshots under ``root`` (a file:// target may be nested), oldest first:
    directories with a ``snapshot.json`` or a ``logs/`` (one a crash or a full disk left
    half-made)."""
    found = []
    for directory, subdirs, files in os.walk(root):
        if META_FILE not in files and LOGS_DIR not in subdirs:
            continue
        subdirs.clear()  # nothing nests in a snapshot
        path = Path(directory)
        try:
            taken = int(read_meta(path)["takenMs"])
        except (OSError, ValueError, KeyError, TypeError):
            taken = 0
        found.append(Kept(path, taken))
    return sorted(found, key=lambda k: (k.taken_ms, str(k.path)))


def prune(root: Path, keep: int) -> list[Kept]:
    """Blocking. Delete all but the newest ``keep`` snapshots under ``root`` (with their
    hold on logs GC deleted: that is when their blocks come back); returns those deleted."""
    kept = list_kept(root)
    doomed = kept[: max(len(kept) - keep, 0)]
    for snap in doomed:
        shutil.rmtree(snap.path, ignore_errors=True)
    return doomed


def kept_bytes(root: Path, ledgers_dir: Path) -> int:
    """Blocking. Bytes the snapshots under ``root`` take on the disk: their files, and the
    logs they alone hold (a link whose log is no longer in ``ledgers_dir``)."""
    total = 0
    for snap in list_kept(root):
        for directory, _subdirs, files in os.walk(snap.path):
            for name in files:
                path = Path(directory, name)
                try:
                    stat = path.stat()
                    if path.parent.name == LOGS_DIR and _same_file(stat, ledgers_dir / name):
                        continue
                except FileNotFoundError:  # pruned meanwhile
                    continue
                total += stat.st_size
    return total


def _same_file(stat: os.stat_result, other: Path) -> bool:
    try:
        return os.path.samestat(stat, other.stat())
    except FileNotFoundError:
        return False
