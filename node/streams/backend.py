"""What a StreamManager needs of what is under it: the node's own ledgers and streams
keyspace (``LedgerStorage``, the embedded default), or replicated ledgers and the metadata
store (``node.streams.replicated.ReplicatedBackend``, when a metadata store is configured).

The manager's rules (rollover, retention, cursors, the order of writes that keeps a stream's
record true across a crash) are the same over both; only where ledgers and records live
differs. Errors are the storage's (``node.storage.errors``): LedgerNotFound for a ledger that
is not there, LedgerClosed/LedgerFenced for adds a closed ledger refused before they were
sent anywhere (the manager retries those on a new ledger).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Protocol

from node.settings import Settings
from node.storage.index import LedgerMeta


class StreamBackend(Protocol):
    settings: Settings

    async def load_records(self) -> dict[bytes, bytes]:
        """Every stream, cursor and doomed record (node.streams.model) known at start."""

    async def write_records(self, changes: dict[bytes, bytes | None]) -> None:
        """Durable, atomic puts and deletes of records (None deletes), all of one stream."""

    def ledgers(self) -> Iterable[LedgerMeta]:
        """The ledgers start() looks through for ones a crash left unnamed."""

    def ledger(self, ledger_id: int) -> LedgerMeta:
        """What the manager reads of a ledger: its LAC, state, counts, properties."""

    async def create_ledger(
        self,
        ledger_id: int | None = None,
        properties: dict[str, str] | None = None,
        write_token: str | None = None,
    ) -> tuple[LedgerMeta, bool]: ...

    async def add_entry(
        self, ledger_id: int, entry_id: int | None, payload: bytes, write_token: str | None = None
    ) -> int: ...

    async def add_entries(
        self, ledger_id: int, payloads: list[bytes], write_token: str | None = None
    ) -> list[int]: ...

    async def close_ledger(self, ledger_id: int, write_token: str | None = None) -> LedgerMeta: ...

    async def delete_ledger(self, ledger_id: int, write_token: str | None = None) -> None: ...

    def read_range(
        self, ledger_id: int, first: int, last: int | None = None
    ) -> AsyncIterator[tuple[int, bytes]]: ...
