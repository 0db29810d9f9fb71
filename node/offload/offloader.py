"""Offload of one closed ledger (Pulsar's offloadLoop, without its metadata-error data loss).

1. Objects of a previous attempt that never completed are deleted; if that fails, this
   attempt does not start (a fresh attempt id would leave them behind unrecorded).
2. A fresh attempt id is recorded durably in the ledger's metadata (in progress).
3. The entries go, in blocks, as one multipart upload of the data object; then the index
   object. A failure deletes this attempt's objects (best effort: the record still names
   them, so the next attempt deletes them if this cannot).
4. Verification: the data object's size, every block's header and CRC read back, and the
   index object read back byte for byte.
5. Only then is the ledger recorded as offloaded. If that write fails, the objects stay:
   the write may have landed, and deleting them would lose the only verified copy once
   the local one goes; the in-progress record makes the next attempt clean up instead.

The local copy is not touched here: it goes after the deletion lag (service.py).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from node.offload.errors import ObjectStoreError, OffloadFailed
from node.offload.format import DataWriter, FormatError, LedgerIndex, check_block
from node.offload.format import data_key as data_key_of
from node.offload.format import index_key as index_key_of
from node.offload.stats import OffloadStats
from node.offload.store import ObjectStore
from node.settings import Settings
from node.storage.clock import Clock
from node.storage.errors import LedgerNotFound
from node.storage.faults import Faults
from node.storage.index import LedgerMeta, LedgerState, OffloadInfo, OffloadState
from node.storage.ledgers import LedgerStorage

log = logging.getLogger(__name__)


class Ineligible(Exception):
    """The ledger cannot be offloaded now; the message is a stable reason."""


def ineligible_reason(meta: LedgerMeta) -> str | None:
    """Why a ledger cannot be offloaded (None: it can)."""
    if meta.state != LedgerState.CLOSED:
        return "not_closed"
    if meta.offload is not None and meta.offload.offloaded:
        return "already_offloaded"
    if meta.lac < 0 or meta.entries == 0:
        return "empty"  # Pulsar: an empty ledger is never offloaded
    if meta.last_entry_id != meta.lac:
        return "entries_above_lac"  # ids past a hole: not a plain 0..LAC ledger
    return None


def metadata_json(meta: LedgerMeta) -> dict[str, object]:
    """The ledger's metadata as the index object keeps it (readable without the node)."""
    return {
        "ledgerId": meta.ledger_id,
        "lac": meta.lac,
        "lastEntryId": meta.last_entry_id,
        "entries": meta.entries,
        "bytes": meta.payload_bytes,
        "created": meta.created_ms,
        "closed": meta.closed_ms,
        "properties": meta.properties,
    }


class OffloadTarget(Protocol):
    """A ledger to offload, and where its offload record lives: the node's own ledger's
    metadata (``LocalLedger``), or a replicated stream's record (``node.offload.streams``)."""

    ledger_id: int

    def meta(self) -> LedgerMeta:
        """The ledger as it is now, its offload record included (LedgerNotFound: gone)."""

    def entries(self, last: int) -> AsyncIterator[tuple[int, bytes]]:
        """Its entries 0..last, in order."""

    async def record(self, offload: OffloadInfo) -> None:
        """Write its offload record durably (LedgerNotFound: gone)."""


class LocalLedger:
    """A ledger of this node's storage: the record is in the ledger's own metadata."""

    def __init__(self, storage: LedgerStorage, ledger_id: int) -> None:
        self._storage = storage
        self.ledger_id = ledger_id

    def meta(self) -> LedgerMeta:
        return self._storage.ledger(self.ledger_id)

    def entries(self, last: int) -> AsyncIterator[tuple[int, bytes]]:
        return self._storage.read_range(self.ledger_id, 0, last)

    async def record(self, offload: OffloadInfo) -> None:
        await self._storage.record_offload(self.ledger_id, offload)


@dataclass(slots=True, frozen=True)
class Uploaded:
    attempt: str
    data_bytes: int


class LedgerOffloader:
    """Offloads one ledger, as this module's docstring says (Pulsar's LedgerOffloader); what
    to offload and when is the OffloadService's."""

    def __init__(
        self,
        store: ObjectStore,
        settings: Settings,
        clock: Clock,
        stats: OffloadStats,
    ) -> None:
        self.store = store
        self._settings = settings
        self._clock = clock
        self._stats = stats
        self._crash = Faults.from_settings(settings)

    async def remove_attempt(self, ledger_id: int, attempt: str) -> None:
        """Delete an attempt's objects (both; missing ones are fine) and abort its upload
        if it never completed (the node killed mid-upload)."""
        for key in (index_key_of(ledger_id, attempt), data_key_of(ledger_id, attempt)):
            await self.store.delete(key)
            self._stats.objects_deleted += 1
        for upload in await self.store.incomplete_uploads(data_key_of(ledger_id, attempt)):
            await self.store.abort_upload(upload)
            self._stats.uploads_aborted += 1

    async def offload(self, target: OffloadTarget) -> Uploaded:
        ledger_id = target.ledger_id
        meta = target.meta()
        reason = ineligible_reason(meta)
        if reason is not None:
            raise Ineligible(reason)
        previous = meta.offload
        if previous is not None and previous.state == OffloadState.IN_PROGRESS:
            log.info(
                "ledger %d: deleting the objects of attempt %s, which never completed",
                ledger_id, previous.attempt,
            )  # fmt: skip
            await self.remove_attempt(ledger_id, previous.attempt)
        attempt = uuid.uuid4().hex
        await target.record(OffloadInfo(OffloadState.IN_PROGRESS, attempt))
        self._crash.hit("offload.after_attempt_recorded")
        try:
            index, index_bytes = await self._upload(target, meta, attempt)
            self._crash.hit("offload.after_upload")
            await self._verify(index, index_bytes, attempt)
        except Exception as e:
            with contextlib.suppress(Exception):
                await self.remove_attempt(ledger_id, attempt)
            # Deleted meanwhile (its stream, retention): its reads and objects went with it.
            target.meta()  # LedgerNotFound: not a failure
            self._stats.upload_failures += 1
            if isinstance(e, ObjectStoreError):
                raise  # its code says whether the store failed, was unreachable or slow
            raise OffloadFailed(
                f"offload of ledger {ledger_id} to {self.store.description} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        done = OffloadInfo(OffloadState.OFFLOADED, attempt, index.data_length, self._clock.now_ms())
        try:
            await target.record(done)
        except LedgerNotFound:
            await self.remove_attempt(ledger_id, attempt)  # deleted while we uploaded
            raise
        self._stats.offloaded_ledgers += 1
        log.info(
            "ledger %d offloaded to %s as attempt %s (%d bytes)",
            ledger_id, self.store.description, attempt, index.data_length,
        )  # fmt: skip
        return Uploaded(attempt, index.data_length)

    async def _upload(
        self, target: OffloadTarget, meta: LedgerMeta, attempt: str
    ) -> tuple[LedgerIndex, bytes]:
        s = self._settings
        writer = DataWriter(
            s.managed_ledger_offload_max_block_size_in_bytes,
            s.managed_ledger_offload_read_buffer_size_in_bytes,
        )

        async def blocks() -> AsyncIterator[bytes]:
            async for entry_id, payload in target.entries(meta.lac):
                block = writer.add(entry_id, payload)
                if block is not None:
                    self._stats.upload_bytes += len(block)
                    yield block
                    self._crash.hit("offload.mid_upload")
            last = writer.finish()
            if last is not None:
                self._stats.upload_bytes += len(last)
                yield last

        await self.store.put_multipart(
            data_key_of(meta.ledger_id, attempt),
            blocks(),
            s.managed_ledger_offload_max_block_size_in_bytes,
        )
        index = writer.index(meta.ledger_id, metadata_json(meta))
        index_bytes = index.encode()
        await self.store.put(index_key_of(meta.ledger_id, attempt), index_bytes)
        self._stats.upload_bytes += len(index_bytes)
        return index, index_bytes

    async def _verify(self, index: LedgerIndex, index_bytes: bytes, attempt: str) -> None:
        lid = index.ledger_id
        key = data_key_of(lid, attempt)
        size = await self.store.size(key)
        if size is None:
            raise FormatError(f"{key} is missing right after its upload")
        if size != index.data_length:
            raise FormatError(f"{key} holds {size} bytes, not {index.data_length}")
        for block in index.blocks:
            data = await self.store.get_range(key, block.offset, block.length)
            check_block(data, block, key)
        stored = await self.store.get(index_key_of(lid, attempt))
        if stored != index_bytes:
            raise FormatError(f"{index_key_of(lid, attempt)} does not read back as written")
