"""The data directory's owner: one process at a time (a node, or an audit of a stopped node).

``data_dir/node.lock`` holds an exclusive ``flock`` for as long as its owner runs, and the
owner's pid as text (for the refusal message only: the lock, not the pid, decides). The
kernel drops a ``flock`` when its last descriptor closes, so a holder that dies in any way
(SIGKILL, a crash, OOM) frees the directory at once: a restart after a crash is never
refused. The descriptor is not inherited by the processes the owner starts (Spark's JVM).

Checked before anything is written in the directory: a second node used to reach RocksDB's
own lock only after opening the index (leaving ``LOG.old.*`` files in the running node's
index) and died with its traceback.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

LOCK_FILE = "node.lock"  # in data_dir
IMAGE_UID = 10001  # the image's node user (Dockerfile), named in the ownership refusals


class DataDirInUse(Exception):
    """Another live process owns the data directory; the message says which and what to do."""

    def __init__(self, data_dir: Path, holder: str) -> None:
        super().__init__(f"data directory {data_dir} is in use by another process ({holder})")
        self.data_dir = data_dir
        self.holder = holder


class DataDirUnusable(Exception):
    """The data directory cannot be created or written; the message says why and the fix."""


def _not_writable(data_dir: Path, where: Path, why: str) -> DataDirUnusable:
    uid = os.getuid()
    if where == data_dir:
        fix = f"give it to the node's user (`chown -R {uid} {data_dir}`"
        what = "is not writable"
    else:
        fix = f"create it and give it to the node's user (`mkdir -p {data_dir} && chown -R {uid} "
        fix += f"{data_dir}`"
        what = "cannot be created or reached"
    return DataDirUnusable(
        f"data directory {data_dir} {what} by this process (uid {uid}): {why}; {fix}: the "
        f"image runs as uid {IMAGE_UID}), or give the node another data directory (--data-dir, "
        "NODE_DATA_DIR)"
    )


def check_usable(data_dir: Path) -> None:
    """DataDirUnusable unless ``data_dir`` is, or can be created as, a writable directory on a
    real file system. Writes nothing: it runs before the disks are sized, which would
    otherwise answer a file, a pseudo file system (/proc: 0 bytes) or a directory this user
    cannot enter with a traceback or a "disk too small"."""
    data_dir = data_dir.absolute()
    existing = data_dir
    while True:  # the nearest part of the path that exists: the directory or a parent
        try:
            mode = os.stat(existing).st_mode
            break
        except (FileNotFoundError, NotADirectoryError):
            existing = existing.parent
        except PermissionError:  # a parent this user may not enter
            parent = existing.parent
            raise _not_writable(data_dir, parent, f"{parent} may not be entered") from None
    if not stat.S_ISDIR(mode):
        if existing == data_dir:
            raise DataDirUnusable(
                f"data directory {data_dir} is a file, not a directory: give the node a "
                "directory (--data-dir, NODE_DATA_DIR)"
            )
        raise DataDirUnusable(
            f"data directory {data_dir} cannot be created: {existing} is a file, not a directory"
        )
    fs = os.statvfs(existing)
    if fs.f_blocks == 0:
        raise DataDirUnusable(
            f"data directory {data_dir} cannot be created or used: {existing} is not on a "
            "usable file system (it holds no blocks: a pseudo file system such as /proc); "
            "give the node a directory on a disk (--data-dir, NODE_DATA_DIR)"
        )
    if fs.f_flag & os.ST_RDONLY:
        raise DataDirUnusable(
            f"data directory {data_dir} cannot be written: {existing} is on a read-only file "
            "system; mount it read-write or give the node another data directory (--data-dir, "
            "NODE_DATA_DIR)"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        owner = os.stat(existing)
        raise _not_writable(
            data_dir,
            existing,
            f"{existing} is owned by uid {owner.st_uid} with mode {stat.filemode(owner.st_mode)}",
        )
    lock = data_dir / LOCK_FILE
    if existing == data_dir and os.path.lexists(lock) and not os.access(lock, os.R_OK | os.W_OK):
        owner = os.stat(lock)
        raise _not_writable(
            data_dir,
            data_dir,
            f"{lock} is owned by uid {owner.st_uid} with mode {stat.filemode(owner.st_mode)}",
        )


class DataDirLock:
    """An owned data directory; ``release`` (or the process's end) gives it back."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, data_dir: Path) -> DataDirLock:
        """Own ``data_dir`` (created if missing), or raise DataDirInUse at once;
        DataDirUnusable when it cannot be created or written (check_usable says why)."""
        path = data_dir / LOCK_FILE
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            # No O_TRUNC: the holder's pid must stay readable until the lock is ours.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            check_usable(data_dir)  # raises with the reason when it can name one
            raise DataDirUnusable(f"data directory {data_dir}: cannot open {path}: {e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise DataDirInUse(data_dir, f"pid {holder}" if holder else "pid unknown") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
