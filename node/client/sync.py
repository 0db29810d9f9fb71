"""A blocking face of the client for scripts: the asyncio Client runs on an event loop in a
thread of its own, and each call waits for its answer.

    with SyncClient("etcd://127.0.0.1:2379/storage") as client:
        ledger = client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        ledger.add(b"payload")
        ledger.close()
        for entry_id, payload in client.open_ledger(ledger.id).read(0, 0): ...
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from node.client.client import Client
from node.client.metadata.store import MetadataStore
from node.client.model import LedgerMetadata
from node.client.reader import ReadHandle
from node.client.writer import LedgerHandle

T = TypeVar("T")


class _Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="node-client", daemon=True
        )
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class SyncLedger:
    def __init__(self, loop: _Loop, handle: LedgerHandle) -> None:
        self._loop, self._handle = loop, handle
        self.id = handle.id

    @property
    def metadata(self) -> LedgerMetadata:
        return self._handle.metadata

    def add(self, payload: bytes) -> int:
        return self._loop.run(self._handle.add(payload))

    def add_batch(self, payloads: Sequence[bytes]) -> tuple[int, int]:
        return self._loop.run(self._handle.add_batch(payloads))

    def close(self) -> LedgerMetadata:
        return self._loop.run(self._handle.close())


class SyncReader:
    def __init__(self, loop: _Loop, handle: ReadHandle) -> None:
        self._loop, self._handle = loop, handle
        self.id = handle.id

    @property
    def last_entry_id(self) -> int:
        return self._handle.last_entry_id

    @property
    def metadata(self) -> LedgerMetadata:
        return self._handle.metadata

    def read_lac(self) -> int:
        return self._loop.run(self._handle.read_lac())

    def read(self, first: int, last: int, *, past_lac: bool = False) -> Iterator[tuple[int, bytes]]:
        entries: AsyncIterator[tuple[int, bytes]] = self._handle.read(
            first, last, past_lac=past_lac
        )

        async def step() -> tuple[int, bytes] | None:
            try:
                return await anext(entries)
            except StopAsyncIteration:
                return None

        while (item := self._loop.run(step())) is not None:
            yield item


class SyncClient:
    """Client's calls, blocking. Keyword arguments are Client's."""

    def __init__(self, store: str | MetadataStore, **kwargs: Any) -> None:
        self._loop = _Loop()
        self.client = Client(store, **kwargs)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._loop.run(self.client.close())
        self._loop.stop()

    def create_ledger(
        self,
        ensemble: int = 3,
        write_quorum: int = 3,
        ack_quorum: int = 2,
        properties: Mapping[str, str] | None = None,
    ) -> SyncLedger:
        handle = self._loop.run(
            self.client.create_ledger(ensemble, write_quorum, ack_quorum, properties)
        )
        return SyncLedger(self._loop, handle)

    def open_ledger(self, ledger_id: int, *, recover: bool = False) -> SyncReader:
        handle = self._loop.run(self.client.open_ledger(ledger_id, recover=recover))
        return SyncReader(self._loop, handle)

    def recover_ledger(self, ledger_id: int) -> dict[str, Any]:
        return self._loop.run(self.client.recover_ledger(ledger_id))

    def ledger_metadata(self, ledger_id: int) -> dict[str, Any]:
        return self._loop.run(self.client.ledger_metadata(ledger_id))

    def ledgers(self) -> list[int]:
        return self._loop.run(self.client.ledgers())

    def delete_ledger(self, ledger_id: int) -> None:
        self._loop.run(self.client.delete_ledger(ledger_id))
