"""The ``faults`` setting's syntax, and what an armed point does to real files (the node's
answers to each fault are in tests/crash/test_faults.py)."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest

import node
from node.faultpoints import STEP_POINTS, parse
from node.settings import SettingsError, load
from node.storage.faults import Faults

HIT = re.compile(r'(?:\.hit|_crash_if)\((?:ledgers, )?"([a-z_.]+)"\)')  # a step point in the code


def test_nothing_armed_hands_out_the_plain_calls() -> None:
    """With no fault set, an I/O point costs nothing: it is the ``os`` function itself."""
    faults = Faults(frozenset({"journal.rotate.before"}), ["entrylog.write=eio"])
    assert faults.pwrite("journal.write") is os.pwrite
    assert faults.pwritev("journal.write") is os.pwritev
    assert faults.sync("journal.fsync") is os.fdatasync
    assert faults.sync("entrylog.fsync", os.fsync) is os.fsync
    assert faults.pwrite("entrylog.write") is not os.pwrite
    Faults().hit("journal.rotate.before")  # not armed: nothing happens


@pytest.mark.parametrize(
    "entry",
    [
        "journal.write",  # no action
        "journal.wirte=eio",  # no such point: it would never fire
        "checkpoint.mark=short",  # a step: no bytes to cut
        "=eio",  # no point
        "journal.write=enospc",  # unknown action
        "journal.fsync=delay",  # delay without seconds
        "journal.fsync=delay:soon",
        "journal.fsync=delay:-1",
        "journal.fsync=short",  # a short write at a sync
        "journal.write=eio,after=-1",
        "journal.write=eio,every=2",
    ],
)
def test_a_fault_the_node_does_not_understand_refuses_the_start(
    entry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="fault"):
        parse(entry)
    monkeypatch.setenv("NODE_FAULTS", json.dumps([entry]))
    with pytest.raises(SettingsError, match="faults"):
        load()


def test_every_step_point_is_known() -> None:
    """Each name the code hits is a point the faults setting accepts."""
    named = set()
    for path in Path(node.__file__).parent.rglob("*.py"):
        named.update(HIT.findall(path.read_text()))
    assert named == STEP_POINTS


def test_a_fault_entry_with_its_options() -> None:
    fault = parse("journal.fsync=delay:2.5,after=3,times=1")
    assert (fault.point, fault.action, fault.delay_s, fault.after, fault.times) == (
        "journal.fsync",
        "delay",
        2.5,
        3,
        1,
    )


def test_after_and_times_choose_the_calls_that_fail(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        sync = Faults(faults=["journal.fsync=eio,after=2,times=2"]).sync("journal.fsync")
        outcomes = []
        for _ in range(6):
            try:
                sync(fd)
                outcomes.append("ok")
            except OSError as e:
                assert e.errno == errno.EIO and "journal.fsync" in str(e)
                outcomes.append("eio")
        assert outcomes == ["ok", "ok", "eio", "eio", "ok", "ok"]
    finally:
        os.close(fd)


def test_a_short_write_lands_half_then_the_next_call_fails(tmp_path: Path) -> None:
    """As a disk failing mid-write: the first call writes and returns a part (whole units),
    the writer's call for the rest gets EIO."""
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        pwrite = Faults(faults=["blockwal.write=short,times=1"]).pwrite("blockwal.write", 4096)
        data = bytes(range(256)) * 48  # 12 KiB: half is 6 KiB, one whole 4 KiB unit
        assert pwrite(fd, data, 0) == 4096
        with pytest.raises(OSError) as failed:
            pwrite(fd, data[4096:], 4096)
        assert failed.value.errno == errno.EIO
        assert os.pread(fd, len(data), 0) == data[:4096]
        assert pwrite(fd, data, 0) == len(data)  # fired once: the point passes again
    finally:
        os.close(fd)
