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

The points and the grammar of an entry are node/faultpoints.py's.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from node.faultpoints import WRITE_ONLY, Fault, parse

if TYPE_CHECKING:
    from node.settings import Settings

Pwrite = Callable[[int, bytes | memoryview, int], int]
Pwritev = Callable[[int, Sequence[bytes | memoryview], int], int]
Sync = Callable[[int], None]


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
