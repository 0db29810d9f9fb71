"""Direct I/O on a raw block device or a preallocated file (the raw-device WAL's medium).

O_DIRECT moves data between the device and the process's own memory, bypassing the page
cache: a WAL written this way does not evict the pages that catch-up readers need, and its
writes cost no copy into the cache. The price is alignment: buffer addresses, file offsets
and lengths must be multiples of the device's logical block size. Anonymous ``mmap`` memory
is page aligned, so buffers come from there (and the WAL uses 4 KiB, a multiple of every
common logical block size, for offsets and lengths).

O_DIRECT alone does not make a write durable: a device with a volatile write cache may still
hold it. Callers ``fdatasync`` after writes, or open with ``dsync`` (O_DSYNC: each write is
on stable storage when it returns), unless the device has no such cache.

A file system without O_DIRECT (tmpfs, some FUSE file systems) refuses the flag with EINVAL;
files there are opened without it (writes go through the page cache, fdatasync still makes
them durable) and ``RawFile.direct`` says so. A block device must support O_DIRECT.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from node.storage.faults import Pwrite
from node.storage.fsutil import fsync_dir

log = logging.getLogger(__name__)

BLKSSZGET = 0x1268  # ioctl: the logical block size of a block device (linux/fs.h)
BLKSSZGET_RESULT = struct.Struct("i")  # it answers with a C int
ZERO_CHUNK = 1 << 20  # zero-filling a new file goes in steps of this size


class DeviceError(OSError):
    """A path that cannot serve as a raw WAL medium (wrong type, too small, misaligned)."""


@dataclass(slots=True)
class RawFile:
    """An open device or file: ``size`` usable bytes from offset 0."""

    path: Path
    fd: int
    size: int
    block_device: bool
    direct: bool  # opened with O_DIRECT
    logical_block_size: int

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def aligned_buffer(size: int) -> mmap.mmap:
    """Zeroed, page-aligned memory of at least ``size`` bytes, usable for O_DIRECT."""
    pages = -(-max(size, 1) // mmap.PAGESIZE)
    return mmap.mmap(-1, pages * mmap.PAGESIZE)


def _logical_block_size(fd: int) -> int:
    answer = fcntl.ioctl(fd, BLKSSZGET, bytes(BLKSSZGET_RESULT.size))
    return int(BLKSSZGET_RESULT.unpack(answer)[0])


def _open_direct(path: Path, flags: int) -> tuple[int, bool]:
    """Open with O_DIRECT, or without it where the file system refuses it (EINVAL)."""
    try:
        return os.open(path, flags | os.O_DIRECT), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    log.warning(
        "%s: the file system does not support O_DIRECT; the WAL goes through the page cache "
        "(fdatasync'ed before acknowledging, whatever wal_volatile_write_cache says)",
        path,
    )
    return os.open(path, flags), False


def create_file(path: Path, size: int) -> None:
    """A new file of ``size`` bytes, allocated and zero-filled, then made durable.

    Zeros rather than ``fallocate`` alone: an O_DIRECT write into an unwritten extent makes
    the file system convert it, a metadata change that each fdatasync would have to commit
    for the whole first lap of the ring."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with contextlib.suppress(OSError):  # not every file system can; writing allocates too
            os.posix_fallocate(fd, 0, size)
        zeros = bytes(min(ZERO_CHUNK, size))
        position = 0
        while position < size:
            position += os.pwrite(fd, zeros[: min(len(zeros), size - position)], position)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    fsync_dir(path.parent)


def open_raw(path: Path, writable: bool, dsync: bool = False) -> RawFile:
    """Open a block device or a regular file for direct I/O (blocking); ``dsync``: every
    write returns only once durable (O_DSYNC)."""
    mode = os.stat(path).st_mode
    flags = (os.O_RDWR if writable else os.O_RDONLY) | (os.O_DSYNC if dsync else 0)
    if stat.S_ISBLK(mode):
        fd = os.open(path, flags | os.O_DIRECT)
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
            block_size = _logical_block_size(fd)
        except BaseException:
            os.close(fd)
            raise
        return RawFile(path, fd, size, True, True, block_size)
    if not stat.S_ISREG(mode):
        raise DeviceError(f"{path} is neither a block device nor a regular file")
    fd, direct = _open_direct(path, flags)
    try:
        size = os.fstat(fd).st_size
        block_size = os.fstatvfs(fd).f_bsize
    except BaseException:
        os.close(fd)
        raise
    return RawFile(path, fd, size, False, direct, block_size)


def read_exactly(raw: RawFile, buffer: mmap.mmap, length: int, position: int) -> memoryview:
    """Read ``length`` bytes at ``position`` into ``buffer`` (all three aligned for O_DIRECT);
    returns a view of them. Short reads (signals, the end of the device) are retried once per
    missing part; reading past the end raises."""
    view = memoryview(buffer)[:length]
    done = 0
    while done < length:
        got = os.preadv(raw.fd, [view[done:]], position + done)
        if got <= 0:
            view.release()
            raise DeviceError(f"{raw.path}: read of {length} bytes at {position} hit the end")
        done += got
    return view


def write_exactly(
    raw: RawFile, data: memoryview, position: int, pwrite: Pwrite = os.pwrite
) -> None:
    """One ``pwrite`` of ``data`` at ``position``; a short write (which O_DIRECT on a healthy
    device does not do) is an error rather than retried, so a block is one I/O."""
    written = pwrite(raw.fd, data, position)
    if written != len(data):
        raise DeviceError(
            errno.EIO, f"{raw.path}: short write of {written} of {len(data)} bytes at {position}"
        )
