"""A journal rotation when the process has no descriptor left (EMFILE): not fatal. The
current file takes the writes past journal_max_size, and the rotation happens at the first
write after descriptors are free again. Real exhaustion: this process's own limit, filled."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from node.settings import Settings
from node.storage.wal import LogMark, WalRecord
from tests.storage.test_journal_scan import append, journal_settings, new_journal, recover_all

SPARE = 16  # descriptors above those in use when the limit is lowered (then taken too)
RECORD = b"r" * 1000
MAX_SIZE = 64 << 10


def take_every_descriptor() -> list[int]:
    """Lower this process's limit near what it uses and open until EMFILE."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + SPARE, hard))
    held = []
    while True:
        try:
            held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as e:
            assert e.errno == errno.EMFILE
            return held


@contextlib.asynccontextmanager
async def no_descriptor_left() -> AsyncIterator[None]:
    """Within it, every open() of this process fails with EMFILE (the setup off the loop,
    which the tests keep free of blocking calls)."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = await asyncio.to_thread(take_every_descriptor)
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, limit)


def test_a_rotation_without_a_descriptor_waits_and_writes_go_on() -> None:
    async def run(s: Settings) -> tuple[list[LogMark], LogMark]:
        j = new_journal(s)
        await j.start()
        try:
            past_max = MAX_SIZE // len(RECORD) * 2  # twice journal_max_size, a write each
            async with no_descriptor_left():
                starved = [await append(j, (1, i, RECORD)) for i in range(past_max)]
            await append(j, (1, past_max, RECORD))  # ... and rotates after it
            rotated = await append(j, (1, past_max + 1, RECORD))
        finally:
            await j.close()
        return starved, rotated

    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp), journal_max_size=MAX_SIZE)
        starved, rotated = asyncio.run(run(s))
        first = starved[0].log_id
        assert {mark.log_id for mark in starved} == {first}  # no rotation, no failure
        assert starved[-1].offset > MAX_SIZE
        assert rotated.log_id == first + 1  # after the first write with a descriptor free
        expected = [WalRecord(1, i, RECORD) for i in range(len(starved) + 2)]
        assert recover_all(s) == expected
