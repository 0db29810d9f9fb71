"""Damage done to the node's files on disk, as a bad disk or a stray write would."""

from __future__ import annotations

import os
from pathlib import Path


def flip_byte(path: Path, offset: int, mask: int = 0x5A) -> None:
    """XOR one byte of the file with ``mask``, durably (fsync) before the node reads it."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))
        f.flush()
        os.fsync(f.fileno())
