"""The last add confirmed (LAC) of each ledger, and the long polls waiting for it to pass.

The LAC is the highest entry id such that every entry up to it is durable. Entries become
durable out of order (adds at chosen ids, a hole being filled, groups of concurrent
clients): a durable id past a hole waits in ``_above`` until the hole is filled, then the
LAC moves over it in one step. The LAC itself is kept in each ledger's ``LedgerMeta.lac``
(the index persists it); this module moves it as entries become durable (an explicit LAC,
``transitions``, only raises it, then ``wake``s the polls), and answers the long polls
(BookKeeper's ``readLastAddConfirmed`` with a long poll):

- a poll returns as soon as the LAC passes the id it waits after;
- fencing or closing the ledger answers its polls at once with the LAC (no add moves it
  any more); deleting it fails them; a poll that times out leaves no trace.

Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from node.storage.descriptor import LedgerTable
from node.storage.errors import LedgerNotFound, StorageClosed
from node.storage.index import LedgerMeta, LedgerState

# No add moves the LAC of a ledger in these states: a long poll on one returns at once.
_SEALED = frozenset({LedgerState.FENCED, LedgerState.CLOSED})


class LacTracker:
    """Durable ids above each LAC and the polls waiting on each ledger."""

    def __init__(self, table: LedgerTable) -> None:
        self._table = table
        self._above: dict[int, set[int]] = {}  # durable ids past a hole, by ledger
        self._waiters: dict[int, list[tuple[int, asyncio.Future[int]]]] = {}

    # --- durability -------------------------------------------------------------------------

    def on_durable(self, meta: LedgerMeta, entry_id: int) -> None:
        """Entry ``entry_id`` is durable: raise the LAC over it if it closes the gap."""
        if entry_id <= meta.lac:
            return
        if entry_id != meta.lac + 1:
            # A replicated ledger's entries are striped over its ensemble: this node's ids
            # never close up, and its LAC is the writer's (``writer_lac``), not a prefix.
            if meta.replication is None:
                self._above.setdefault(meta.ledger_id, set()).add(entry_id)
            return
        lac = entry_id
        above = self._above.get(meta.ledger_id)
        if above:
            while lac + 1 in above:
                lac += 1
                above.discard(lac)
            if not above:
                del self._above[meta.ledger_id]
        meta.lac = lac
        if meta.ledger_id in self._waiters:
            self.wake(meta)

    def on_durable_range(self, meta: LedgerMeta, first: int, last: int) -> None:
        """``on_durable`` for entries ``first`` to ``last``: one step when they extend the
        LAC and nothing above it waits."""
        if first == meta.lac + 1 and meta.ledger_id not in self._above:
            meta.lac = last
            if meta.ledger_id in self._waiters:
                self.wake(meta)
            return
        for entry_id in range(first, last + 1):
            self.on_durable(meta, entry_id)

    def is_durable(self, meta: LedgerMeta, entry_id: int) -> bool:
        if entry_id <= meta.lac:
            return True
        above = self._above.get(meta.ledger_id)
        return above is not None and entry_id in above

    def durable_above(self, ledger_id: int) -> Iterable[int]:
        """The ledger's durable ids past its LAC (unordered)."""
        return self._above.get(ledger_id, ())

    def deleted(self, ledger_id: int) -> set[int]:
        """The ledger is being deleted: fail its polls and hand back its durable ids past
        the LAC (``on_durable`` them again should the deletion be undone)."""
        for _after, waiter in self._waiters.pop(ledger_id, []):
            if not waiter.done():
                waiter.set_exception(LedgerNotFound(f"ledger {ledger_id} was deleted"))
        return self._above.pop(ledger_id, set())

    # --- long polls -------------------------------------------------------------------------

    async def wait(self, ledger_id: int, after: int, timeout_s: float) -> int:
        """Long-poll: the LAC once it passes ``after``, or the current LAC at the timeout
        or as soon as the ledger is fenced or closed (no add moves it any more)."""
        meta = self._table.ledger(ledger_id)
        if meta.lac > after or timeout_s <= 0 or meta.state in _SEALED:
            return meta.lac
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(ledger_id, []).append((after, waiter))
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            return self._table.ledger(ledger_id).lac
        finally:
            self._forget(ledger_id, waiter)

    def wake(self, meta: LedgerMeta) -> None:
        """The LAC moved: answer the polls it passed."""
        waiters = self._waiters.get(meta.ledger_id)
        if not waiters:
            return
        keep = []
        for after, waiter in waiters:
            if waiter.done():
                continue
            if meta.lac > after:
                waiter.set_result(meta.lac)
            else:
                keep.append((after, waiter))
        if keep:
            self._waiters[meta.ledger_id] = keep
        else:
            del self._waiters[meta.ledger_id]

    def sealed(self, meta: LedgerMeta) -> None:
        """Answer the ledger's long polls now with its LAC: fenced or closed (the adds in
        flight settled), it will not pass what they wait for."""
        for _after, waiter in self._waiters.pop(meta.ledger_id, []):
            if not waiter.done():
                waiter.set_result(meta.lac)

    def _forget(self, ledger_id: int, waiter: asyncio.Future[int]) -> None:
        """A poll that timed out or was cancelled leaves no trace: on a ledger no add comes
        to, a flood of them would otherwise be kept for good."""
        pending = self._waiters.get(ledger_id)
        if pending is None:
            return  # answered: its list was taken whole
        keep = [(after, other) for after, other in pending if other is not waiter]
        if keep:
            self._waiters[ledger_id] = keep
        else:
            del self._waiters[ledger_id]

    def release(self) -> None:
        """Answer every long poll now with the current LAC (at shutdown)."""
        waiters, self._waiters = self._waiters, {}
        for ledger_id, pending in waiters.items():
            lac = self._table.metas[ledger_id].lac
            for _after, waiter in pending:
                if not waiter.done():
                    waiter.set_result(lac)

    def closed(self) -> None:
        """Fail every poll still waiting: the storage closed."""
        for pending in self._waiters.values():
            for _after, waiter in pending:
                if not waiter.done():
                    waiter.set_exception(StorageClosed("the node is shutting down"))

    @property
    def waiting(self) -> int:
        """Long polls waiting for a LAC to pass."""
        pending = self._waiters.values()
        return sum(not waiter.done() for waiters in pending for _after, waiter in waiters)
