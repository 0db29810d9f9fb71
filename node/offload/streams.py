"""A replicated stream's ledger as offload sees it: its offload record lives in the stream's
record in the metadata store (Pulsar keeps it in the managed ledger's LedgerInfo), written by
the stream's owner; its entries are read through the stream's backend (the replicas, or the
object store once they are gone). Only the owner offloads: every record write is guarded
by its ownership (node.streams.replicated)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from node.storage.errors import LedgerNotFound
from node.storage.index import LedgerMeta, OffloadInfo
from node.streams.manager import StreamManager, StreamNotFound
from node.streams.model import LedgerInfo, Stream


class StreamLedger:
    def __init__(self, streams: StreamManager, stream: str, ledger_id: int) -> None:
        self._streams = streams
        self._stream = stream
        self.ledger_id = ledger_id

    def _info(self) -> tuple[Stream, LedgerInfo]:
        try:
            stream = self._streams.stream(self._stream)
        except StreamNotFound:
            raise LedgerNotFound(f"stream {self._stream} was deleted") from None
        for info in stream.ledgers:
            if info.ledger_id == self.ledger_id:
                return stream, info
        raise LedgerNotFound(f"ledger {self.ledger_id} is no longer part of stream {stream.name}")

    def meta(self) -> LedgerMeta:
        return self._info()[1].meta(self._stream)

    def entries(self, last: int) -> AsyncIterator[tuple[int, bytes]]:
        stream, info = self._info()
        # As stored (a deduplicating stream's with their producer header): the object store
        # holds the ledger, and reads of it strip the header as they do of its replicas.
        return self._streams.stored_entries(stream, info, 0, last)

    async def record(self, offload: OffloadInfo) -> None:
        try:
            await self._streams.record_offload(self._stream, self.ledger_id, offload)
        except StreamNotFound:
            raise LedgerNotFound(f"stream {self._stream} was deleted") from None


def replicated(stream: Stream) -> bool:
    """Whether offload keeps the stream's records (else the ledgers' metadata does)."""
    return stream.replication is not None
