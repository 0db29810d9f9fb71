"""Small durable file-system steps used by every on-disk structure."""

from __future__ import annotations

import errno
import os
from pathlib import Path

# A full file system, or a quota: the write may succeed once space is freed, unlike EIO.
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


# Out of descriptors (the process's, the system's) or kernel memory: an open that may
# succeed a moment later, once connections close; never a sign of damage.
OUT_OF_RESOURCES_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def is_no_space(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in NO_SPACE_ERRNOS


def is_out_of_resources(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in OUT_OF_RESOURCES_ERRNOS


def fsync_dir(directory: Path) -> None:
    """Make a created, renamed or deleted name in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new content."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def usage(path: Path) -> float:
    """Used share of the file system holding ``path`` (its parent if it does not exist)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    stat = os.statvfs(path)
    total = stat.f_blocks * stat.f_frsize
    return 1.0 - stat.f_bavail * stat.f_frsize / total if total else 0.0
