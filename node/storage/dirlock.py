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
from pathlib import Path

LOCK_FILE = "node.lock"  # in data_dir


class DataDirInUse(Exception):
    """Another live process owns the data directory; the message says which and what to do."""

    def __init__(self, data_dir: Path, holder: str) -> None:
        super().__init__(f"data directory {data_dir} is in use by another process ({holder})")
        self.data_dir = data_dir
        self.holder = holder


class DataDirLock:
    """An owned data directory; ``release`` (or the process's end) gives it back."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, data_dir: Path) -> DataDirLock:
        """Own ``data_dir`` (created if missing), or raise DataDirInUse at once."""
        data_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / LOCK_FILE
        # No O_TRUNC: the holder's pid must stay readable until the lock is ours.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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
