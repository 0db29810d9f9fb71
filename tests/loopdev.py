"""Real block devices for tests of the raw-device WAL: loop devices over files (root only).

A test that needs one and cannot get one fails with the reason: it never skips, since the
raw-device path is what it exists to prove.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from node.storage.directio import aligned_buffer, open_raw, read_exactly, write_exactly

LOSETUP_TIMEOUT_S = 30


@contextmanager
def loop_device(backing: Path, size: int) -> Iterator[Path]:
    """A loop device of ``size`` bytes over the new file ``backing``, detached afterwards."""
    with open(backing, "wb") as f:
        f.truncate(size)
    try:
        made = subprocess.run(
            ["losetup", "--find", "--show", str(backing)],
            capture_output=True,
            text=True,
            timeout=LOSETUP_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError:
        pytest.fail("losetup is not installed (util-linux): the raw-device WAL tests need it")
    if made.returncode != 0:
        pytest.fail(
            f"cannot create a loop device over {backing}: {made.stderr.strip()} "
            "(the raw-device WAL tests need root and /dev/loop-control)"
        )
    device = Path(made.stdout.strip())
    try:
        yield device
    finally:
        subprocess.run(["losetup", "--detach", str(device)], timeout=LOSETUP_TIMEOUT_S, check=False)


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
