"""Named fault points (FoundationDB's BUGGIFY, TigerBeetle's storage faults), for tests.

A random SIGKILL lands inside a multi-step protocol only by luck, and a disk that fails a
write or takes seconds over an fsync is rarer still: a test names the point and the fault.
Two settings arm them; with both empty, the default, a point costs nothing at the I/O
sites (the plain ``os`` function is handed out once) and one set lookup at a step.

- ``crash_points``: names of steps where the node SIGKILLs itself (``hit``).
- ``faults``: entries ``<point>=<action>[,after=N][,times=N]``, for example
  ``journal.write=eio``, ``journal.fsync=delay:2.0``, ``entrylog.write=short,times=1``:

  ``eio``          the call fails with EIO, having done nothing
  ``short``        a short write: the first half of the bytes (in whole ``unit``s) is
                   written and counted, then the next call at the point (the writer
                   going on with the rest) fails with EIO, as a disk failing mid-write
  ``short:crash``  the same half written, then SIGKILL (a write torn by a crash)
  ``delay:S``      S seconds of sleep (a slow disk), then the call
  ``crash``        SIGKILL instead of the call

  ``after=N`` lets the first N calls through; ``times=N`` fires N times, then the point
  passes again (default: every call from the first fired on). Counts are per component
  that owns the point. A delay blocks the thread of the call: the I/O points and the
  checkpoint's steps run on worker threads, offload's steps on the event loop.

The points (a fault elsewhere is refused at start, as a name that would never fire):

- I/O points (``IO_POINTS``), every action: ``journal.write`` and ``journal.fsync`` (the
  file journal's group write and its fdatasync), ``blockwal.write`` and ``blockwal.fsync``
  (the raw-device WAL's block writes and its sync thread's fdatasync), ``entrylog.write``
  and ``entrylog.fsync`` (a checkpoint's records into the entry log, and its flush),
  ``entrylog.read`` and ``index.get`` (a read's entry log read and its index lookup, on a
  reader thread: an I/O error there must answer ``io_error``, never "not found").
- Step points (``STEP_POINTS``, through ``hit``), ``eio``, ``delay`` and ``crash``: the
  crash points, and ``checkpoint.mark`` (just before lastMark is written);
  ``stream.rollover.after_record`` is a stream's record naming its new ledger written, the
  old one not closed yet; ``autorecovery.after_copy`` is a fragment copied to its
  replacement and read back, the segment's CAS not sent (a node's re-replication route).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast, get_args

if TYPE_CHECKING:
    from node.settings import Settings

IO_POINTS = frozenset(
    {
        "journal.write",
        "journal.fsync",
        "blockwal.write",
        "blockwal.fsync",
        "entrylog.write",
        "entrylog.fsync",
        "entrylog.read",
        "index.get",
    }
)
STEP_POINTS = frozenset(
    {
        "checkpoint.before_entrylog",
        "checkpoint.after_entrylog_fsync",
        "checkpoint.after_index",
        "checkpoint.mark",
        "checkpoint.after_mark",
        "journal.rotate.before",
        "journal.rotate.after",
        "blockwal.trim.before_header",
        "blockwal.trim.after_header",
        "compaction.after_copy",
        "compaction.after_seal",
        "compaction.after_marker",
        "compaction.after_rename",
        "compaction.after_index",
        "compaction.after_retire",
        "offload.after_attempt_recorded",
        "offload.mid_upload",
        "offload.after_upload",
        "stream.rollover.after_record",
        "autorecovery.after_copy",
    }
)
Action = Literal["eio", "short", "short:crash", "delay", "crash"]
WRITE_ONLY: frozenset[Action] = frozenset({"short", "short:crash"})

Pwrite = Callable[[int, bytes | memoryview, int], int]
Pwritev = Callable[[int, Sequence[bytes | memoryview], int], int]
Sync = Callable[[int], None]


@dataclass(slots=True)
class Fault:
    point: str
    action: Action
    delay_s: float = 0.0
    after: int = 0  # calls let through first
    times: int | None = None  # fires this many times; None: for good
    calls: int = 0
    cut: bool = False  # a short write happened: the next call fails

    def due(self) -> bool:
        """Count a call; whether the fault fires on it."""
        self.calls += 1
        fired = self.calls - self.after
        return fired > 0 and (self.times is None or fired <= self.times)


def parse(entry: str) -> Fault:
    """``<point>=<action>[,after=N][,times=N]``; ValueError says what is wrong."""
    point, sep, rest = entry.partition("=")
    if not sep or not point:
        raise ValueError(f"fault {entry!r}: expected <point>=<action>")
    action, *options = rest.split(",")
    fault = Fault(point, "eio")
    if action.startswith("delay:"):
        fault.action = "delay"
        try:
            fault.delay_s = float(action.removeprefix("delay:"))
        except ValueError:
            raise ValueError(f"fault {entry!r}: delay:<seconds> expected") from None
        if fault.delay_s < 0:
            raise ValueError(f"fault {entry!r}: a negative delay")
    elif action in get_args(Action) and action != "delay":
        fault.action = cast(Action, action)
    else:
        raise ValueError(
            f"fault {entry!r}: action {action!r} is not eio, short, short:crash, delay:S or crash"
        )
    if point not in IO_POINTS | STEP_POINTS:
        raise ValueError(f"fault {entry!r}: no point {point!r} (see node/storage/faults.py)")
    if fault.action in WRITE_ONLY and not point.endswith(".write"):
        raise ValueError(f"fault {entry!r}: a short write only happens at a .write point")
    for option in options:
        key, _, value = option.partition("=")
        if key not in ("after", "times") or not value.isdigit():
            raise ValueError(f"fault {entry!r}: option {option!r} is not after=N or times=N")
        setattr(fault, key, int(value))
    return fault


def _eio(point: str) -> OSError:
    return OSError(errno.EIO, f"injected fault at {point}: {os.strerror(errno.EIO)}")


def _nothing() -> None:
    pass


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Faults:
    """The armed points of one component (``from_settings``), or none (``Faults()``)."""

    def __init__(
        self, crash_points: frozenset[str] = frozenset(), faults: Iterable[str] = ()
    ) -> None:
        self._crash = crash_points
        self._faults = {fault.point: fault for fault in map(parse, faults)}
        self._armed = crash_points | self._faults.keys()
        self._lock = threading.Lock()  # counts: points are hit from worker threads

    @classmethod
    def from_settings(cls, settings: Settings) -> Faults:
        return cls(settings.crash_points, settings.faults)

    def hit(self, name: str) -> None:
        """A step of a protocol: SIGKILL if it is a crash point, or its fault (a short
        write has no bytes to cut here: parse refuses it)."""
        if name in self._armed:
            if name in self._crash:
                _kill()
            self._fire(name)

    def _due(self, point: str) -> Fault | None:
        """The fault to apply to this call, if any; EIO for the call after a short write."""
        fault = self._faults.get(point)
        if fault is None:
            return None
        with self._lock:
            if fault.cut:
                fault.cut = False
                raise _eio(point)
            return fault if fault.due() else None

    def _fire(self, point: str) -> None:
        fault = self._due(point)
        if fault is not None:
            self._act(fault)

    def step(self, point: str) -> Callable[[], None]:
        """A call that fires ``point``'s fault (the read points): a no-op when nothing is
        armed there."""
        if point not in self._armed:
            return _nothing
        return lambda: self._fire(point)

    def pwrite(self, point: str, unit: int = 1) -> Pwrite:
        """``os.pwrite`` at ``point``: the plain function when nothing is armed there. A
        short write cuts at a multiple of ``unit`` (O_DIRECT writes whole blocks)."""
        if point not in self._armed:
            return os.pwrite

        def pwrite(fd: int, data: bytes | memoryview, offset: int) -> int:
            fault = self._due(point)
            if fault is None:
                return os.pwrite(fd, data, offset)
            if fault.action in WRITE_ONLY:
                return self._short(fault, fd, data, offset, unit)
            self._act(fault)
            return os.pwrite(fd, data, offset)

        return pwrite

    def pwritev(self, point: str) -> Pwritev:
        """``os.pwritev`` at ``point``, as ``pwrite``."""
        if point not in self._armed:
            return os.pwritev

        def pwritev(fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> int:
            fault = self._due(point)
            if fault is None:
                return os.pwritev(fd, buffers, offset)
            if fault.action in WRITE_ONLY:
                return self._short(fault, fd, b"".join(buffers), offset, 1)
            self._act(fault)
            return os.pwritev(fd, buffers, offset)

        return pwritev

    def sync(self, point: str, sync: Sync = os.fdatasync) -> Sync:
        """``sync`` (fdatasync, fsync) at ``point``: itself when nothing is armed there."""
        if point not in self._armed:
            return sync

        def faulty_sync(fd: int) -> None:
            self._fire(point)
            sync(fd)

        return faulty_sync

    def _short(
        self, fault: Fault, fd: int, data: bytes | memoryview, offset: int, unit: int
    ) -> int:
        """Write the first half of ``data`` (whole ``unit``s) and return its length, the
        next call failing; or die once it is written (``short:crash``)."""
        part = len(data) // 2 // unit * unit
        if part:
            os.pwrite(fd, memoryview(data)[:part], offset)
        if fault.action == "short:crash":
            _kill()
        if not part:
            raise _eio(fault.point)
        with self._lock:
            fault.cut = True
        return part

    @staticmethod
    def _act(fault: Fault) -> None:
        """eio, delay or crash (a short write's cut is ``_short``'s)."""
        if fault.action == "delay":
            time.sleep(fault.delay_s)
        elif fault.action == "crash":
            _kill()
        else:
            raise _eio(fault.point)
