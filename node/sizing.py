"""Disk-bound defaults sized to the disks the node finds, and a refusal to start on a disk
too small for the settings.

The defaults (2 GiB journals with 5 kept as backups, a 64 MiB write cache whose contents
the journal holds until a checkpoint, 1 GiB entry logs, a 64 MiB emergency reserve) are
BookKeeper's and suit disks of tens of GiB. On a small volume they do not fit: an entry
log never rolls, so GC has no sealed log to reclaim; the journal never rotates, so no
checkpoint gives its space back; the reserve cannot be made. The node then fills up with
its own working space and cannot recover.

So at start every such knob that was not set explicitly is lowered to a share of the file
system holding it (never raised), and logged. Explicit settings are kept as given; if the
working space they need passes the read-only watermark of their disk, the node refuses to
start and says which settings to lower. On a disk of 32 GiB or more nothing changes.

Working space, per file system (the worst case the node itself holds, beside the data):

    journal   write cache (the journal holds it until a checkpoint)
              + (1 + journal_max_backups) x journal_max_size + journal_pre_alloc_size
    ledgers   log_size_limit (the output of a compaction, before its inputs go)
    data dir  disk_emergency_reserve_bytes
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from node.settings import KiB, MiB, Settings, SettingsError

log = logging.getLogger(__name__)

# Share of its file system that a knob may take when it was not set explicitly. Together,
# at most ~0.45 of a disk that holds everything is working space; the rest is for data.
SHARES: dict[str, float] = {
    "journal_max_size": 1 / 16,
    "journal_pre_alloc_size": 1 / 64,
    "db_storage_write_cache_max_size": 1 / 8,
    "log_size_limit": 1 / 16,
    "max_entry_size": 1 / 32,
    # as large as an entry log: released, it lets compaction copy any one log's live part
    "disk_emergency_reserve_bytes": 1 / 16,
}
BACKUPS_SHARE = 1 / 16  # journal backups together take at most this share of their disk
ROUNDING = 4 * KiB  # fitted sizes are whole file-system blocks


@dataclass(frozen=True, slots=True)
class Disk:
    """The file system holding one of the node's directories."""

    device: int
    size: int  # bytes the file system holds (statvfs f_blocks)


def disk_of(path: Path) -> Disk:
    """The file system of ``path``, or of its nearest existing parent (a first start)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    stat = os.statvfs(path)
    return Disk(os.stat(path).st_dev, stat.f_blocks * stat.f_frsize)


def fit_to_disks(settings: Settings) -> Settings:
    """``settings`` with the disk-bound defaults sized to their disks; SettingsError if
    the explicit settings need more working space than a disk has below its read-only
    watermark. Blocking (statvfs): call before the event loop runs."""
    journal = disk_of(settings.journal_dir)
    ledgers = disk_of(settings.ledgers_dir)
    data = disk_of(settings.data_dir)
    on_disk = {
        "journal_max_size": journal,
        "journal_pre_alloc_size": journal,
        "db_storage_write_cache_max_size": journal,
        "log_size_limit": ledgers,
        "max_entry_size": ledgers,
        "disk_emergency_reserve_bytes": data,
    }
    explicit = settings.model_fields_set
    changes: dict[str, int] = {}
    for name, share in SHARES.items():
        if name in explicit:
            continue
        alignment = max(ROUNDING, settings.journal_alignment_size)
        fitted = max(alignment, int(on_disk[name].size * share) // alignment * alignment)
        if fitted < getattr(settings, name):
            changes[name] = fitted
    _keep_relations(settings, explicit, changes)
    if "journal_max_backups" not in explicit:
        journal_max = changes.get("journal_max_size", settings.journal_max_size)
        backups = int(journal.size * BACKUPS_SHARE) // journal_max
        if backups < settings.journal_max_backups:
            changes["journal_max_backups"] = backups
    fitted_settings = settings
    if changes:
        log.warning(
            "sized to the disks (data dir %s, journal %s, ledgers %s): %s; set NODE_<NAME> "
            "to choose another value",
            _size(data.size),
            _size(journal.size),
            _size(ledgers.size),
            ", ".join(
                f"{name} {_show(name, value)} (default {_show(name, getattr(settings, name))})"
                for name, value in changes.items()
            ),
        )
        values = {**settings.model_dump(), **changes}
        fitted_settings = Settings.model_construct(_fields_set=explicit, **values)
    _check_working_space(fitted_settings, journal, ledgers, data)
    return fitted_settings


def _keep_relations(settings: Settings, explicit: set[str], changes: dict[str, int]) -> None:
    """The settings' own rules hold after fitting: an entry fits half an entry log and
    half the write cache, preallocation steps stay within a journal file."""
    entry = changes.get("max_entry_size", settings.max_entry_size)
    for name in ("log_size_limit", "db_storage_write_cache_max_size"):
        if name in changes and changes[name] < 2 * entry:
            changes[name] = min(2 * entry, getattr(settings, name))
    journal_max = changes.get("journal_max_size", settings.journal_max_size)
    prealloc = changes.get("journal_pre_alloc_size", settings.journal_pre_alloc_size)
    if "journal_pre_alloc_size" not in explicit and prealloc > journal_max:
        changes["journal_pre_alloc_size"] = journal_max


def working_space(
    settings: Settings, journal: Disk, ledgers: Disk, data: Disk
) -> dict[int, list[tuple[str, int]]]:
    """What the node needs for itself on each file system (device -> named parts)."""
    s = settings
    parts: dict[int, list[tuple[str, int]]] = {}

    def add(disk: Disk, what: str, size: int) -> None:
        parts.setdefault(disk.device, []).append((what, size))

    if s.wal_kind == "journal":
        add(
            journal,
            "db_storage_write_cache_max_size (held by the journal)",
            s.db_storage_write_cache_max_size,
        )
        add(
            journal,
            "(1 + journal_max_backups) x journal_max_size",
            (1 + s.journal_max_backups) * s.journal_max_size,
        )
        add(journal, "journal_pre_alloc_size", s.journal_pre_alloc_size)
    add(ledgers, "log_size_limit (a compaction's output)", s.log_size_limit)
    add(data, "disk_emergency_reserve_bytes", s.disk_emergency_reserve_bytes)
    return parts


def _check_working_space(settings: Settings, journal: Disk, ledgers: Disk, data: Disk) -> None:
    sizes = {d.device: d.size for d in (journal, ledgers, data)}
    for device, parts in working_space(settings, journal, ledgers, data).items():
        needed = sum(size for _what, size in parts)
        budget = settings.disk_usage_threshold * sizes[device]
        if needed > budget:
            raise SettingsError(
                f"the disk holding {_dirs_on(settings, device)} is {_size(sizes[device])}, too "
                f"small for these settings: they need {_size(needed)} of working space "
                f"({_listing(parts)}), more than the {_size(int(budget))} below the read-only "
                f"watermark (disk_usage_threshold {settings.disk_usage_threshold}); lower "
                "them, or leave them unset to have them sized to the disk"
            )


def _dirs_on(settings: Settings, device: int) -> str:
    dirs = [settings.journal_dir, settings.ledgers_dir, settings.data_dir]
    return ", ".join(str(d) for d in dirs if disk_of(d).device == device)


def _listing(parts: Iterable[tuple[str, int]]) -> str:
    return ", ".join(f"{what} {_size(size)}" for what, size in parts)


def _show(name: str, value: int) -> str:
    return str(value) if name == "journal_max_backups" else _size(value)


def _size(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n < 1024 * MiB else f"{n / (1024 * MiB):.1f} GiB"
