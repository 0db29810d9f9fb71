"""Appends that did not end in an acknowledgment: refused by the WAL, or abandoned by
their caller.

An add caches its entry and counts it (last entry id, counts) before the WAL writes it,
so that the append and the cache put are one synchronous step. Most adds then become
durable and move the LAC; these are the others:

- **refused** (``DiskFull``, ``Backpressure``): the bytes are not in the WAL and never will
  be. They are forgotten (write cache, counts, last entry id), so that a retry of the same
  ids is a fresh add (not an "identical bytes" no-op answered from the cache), the next
  ids handed out leave no hole the LAC cannot pass, and no checkpoint writes an entry a
  client was told failed. Appends of the same batch that did land still count.
- **abandoned** (the caller was cancelled): the records are queued and land anyway, and
  the LAC must pass them when they do (else it would stop at them for good).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from node.storage.cache import WriteCaches
from node.storage.descriptor import LedgerTable
from node.storage.errors import Backpressure, DiskFull
from node.storage.index import LedgerMeta
from node.storage.lac import LacTracker
from node.storage.wal import LogMark

# (entry id, payload, the future of its append), one per append of an add or a batch.
Appended = list[tuple[int, bytes, asyncio.Future[LogMark]]]


class AppendSettler:
    """Settles failed appends; on the event loop."""

    def __init__(self, table: LedgerTable, caches: WriteCaches, lac: LacTracker) -> None:
        self._table = table
        self._caches = caches
        self._lac = lac

    def failed(
        self,
        meta: LedgerMeta,
        last: asyncio.Future[LogMark],
        error: BaseException,
        appended: Callable[[], Appended],
    ) -> None:
        """Called when awaiting ``last``, the future of the last of some appends (groups
        complete in order: it covers them all), raised ``error``; the caller re-raises it.
        (A plain try/except around the await at each call site, not a coroutine wrapping
        it: one frame less on every add's wake-up.) ``appended`` lists the appends, made
        only on these rare paths."""
        if isinstance(error, DiskFull | Backpressure):
            self.refused(meta, appended())
        elif isinstance(error, asyncio.CancelledError):
            pending = appended()
            last.add_done_callback(lambda done: self._abandoned(meta, pending, done))

    def refused(self, meta: LedgerMeta, appended: Appended) -> None:
        """The WAL refused the appends: those that landed all the same count, the rest are
        forgotten."""
        failed = []
        for entry_id, payload, future in appended:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._lac.on_durable(meta, entry_id)  # an earlier write of the batch landed
            else:
                failed.append((entry_id, payload))
        self._forget(meta, failed)

    def _abandoned(
        self, meta: LedgerMeta, appended: Appended, done: asyncio.Future[LogMark]
    ) -> None:
        error = None if done.cancelled() else done.exception()
        if error is None and not done.cancelled():
            for entry_id, _payload, _future in appended:
                self._lac.on_durable(meta, entry_id)
        elif isinstance(error, DiskFull | Backpressure):
            self.refused(meta, appended)

    def _forget(self, meta: LedgerMeta, failed: list[tuple[int, bytes]]) -> None:
        ledger_id = meta.ledger_id
        for entry_id, payload in failed:
            # Only the bytes this add cached. A checkpoint's frozen cache may hold them: its
            # mark covers this append and failed with it, so no flush thread reads it.
            self._caches.remove(ledger_id, entry_id, payload)
            meta.entries -= 1
            meta.payload_bytes -= len(payload)
        if any(entry_id >= meta.last_entry_id for entry_id, _payload in failed):
            meta.last_entry_id = max(
                meta.lac,
                max(self._lac.durable_above(ledger_id), default=-1),
                self._caches.highest_entry_id(ledger_id),
            )
        if self._table.metas.get(ledger_id) is meta:
            self._table.dirty.add(ledger_id)
