"""Read-only mode: why the node refuses adds and new ledgers, by who asked.

Two sources set it independently: an operator (the admin API) and a full disk (a write
that found no space, or the disk monitor's watermark). Each lifts only its own reason, so
an operator's read-only mode outlasts a disk that recovers, and the other way round
(BookKeeper: a manual transition is sticky). Reads, fence, close and delete go on while it
holds: they are how a full node recovers. A storage that is not running (before start,
after close) refuses the same writes (``StorageClosed``).
"""

from __future__ import annotations

import enum
import logging

from node.storage.errors import DiskFull, NodeReadOnly, StorageClosed

log = logging.getLogger(__name__)


class ReadOnlySource(enum.StrEnum):
    """Who set a read-only reason (the values are those logs and callers always saw)."""

    OPERATOR = "operator"
    DISK = "disk"


class ReadOnlyState:
    """The reasons in force, by source, and whether the storage runs. Lives on the loop."""

    __slots__ = ("_reasons", "_running", "held", "writable")

    def __init__(self) -> None:
        self._reasons: dict[ReadOnlySource, str] = {}
        self._running = False
        self.held = False  # any reason in force
        self.writable = False  # running and no reason in force (an attribute: adds test it)

    @property
    def running(self) -> bool:
        return self._running

    def set_running(self, running: bool) -> None:
        self._running = running
        self.writable = running and not self.held

    def set(self, reason: str | None, source: ReadOnlySource) -> None:
        """Hold the node read-only for ``reason``, or (None) lift what ``source`` set."""
        before = self.reason
        if reason is None:
            self._reasons.pop(source, None)
        else:
            self._reasons[source] = reason
        self.held = bool(self._reasons)
        self.writable = self._running and not self.held
        if self.reason != before:
            now = f"read-only: {self.reason}" if self._reasons else "writable"
            log.warning("node is now %s", now)

    def holds(self, source: ReadOnlySource) -> bool:
        return source in self._reasons

    @property
    def reason(self) -> str | None:
        """Every reason in force, joined; None when writable."""
        return "; ".join(self._reasons.values()) or None

    def check_running(self) -> None:
        if not self._running:
            raise StorageClosed("the storage is not running")

    def check(self) -> None:
        """Refuse a write unless writable: not running, ``StorageClosed``; read-only, 507
        (``DiskFull``) when the disk is a reason, as only space frees it, else
        ``NodeReadOnly``."""
        self.check_running()
        if not self._reasons:
            return
        disk = self._reasons.get(ReadOnlySource.DISK)
        if disk is not None:
            raise DiskFull(f"the node is read-only: {disk}")
        raise NodeReadOnly(f"the node is read-only: {self.reason}")
