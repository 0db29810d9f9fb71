"""Real block devices for tests of the raw-device WAL: loop devices over files (root only).

A test that needs one and cannot get one fails with the reason: it never skips, since the
raw-device path is what it exists to prove.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from node.bench.wal import NoLoopDevice
from node.bench.wal import loop_device as make_loop_device
from node.storage.directio import aligned_buffer, open_raw, read_exactly, write_exactly


@contextmanager
def loop_device(backing: Path, size: int) -> Iterator[Path]:
    """A loop device of ``size`` bytes over the new file ``backing``, detached afterwards."""
    with ExitStack() as stack:
        try:
            device = stack.enter_context(make_loop_device(backing, size))
        except NoLoopDevice as e:
            pytest.fail(f"cannot create a loop device: {e}; the raw-device WAL tests need one")
        yield device


def snapshot(path: Path, size: int) -> bytearray:
    """The first ``size`` bytes of a device or file, read with O_DIRECT as the WAL reads:
    what a crash at this moment would leave on it."""
    raw = open_raw(path, writable=False)
    buffer = aligned_buffer(size)
    try:
        with read_exactly(raw, buffer, size, 0) as view:
            return bytearray(view)
    finally:
        buffer.close()
        raw.close()


def restore(path: Path, image: bytes | bytearray) -> None:
    """Put an image taken by ``snapshot`` (maybe altered) back, durably."""
    raw = open_raw(path, writable=True)
    buffer = aligned_buffer(len(image))
    try:
        buffer[: len(image)] = image
        with memoryview(buffer) as whole, whole[: len(image)] as data:
            write_exactly(raw, data, 0)
        os.fsync(raw.fd)
    finally:
        buffer.close()
        raw.close()
