"""Tiered storage as the node runs it: which ledgers go (policies), runs on request or on
a schedule, the deletion lag, deletion of objects with their ledger, status.

Selection (Pulsar's maybeOffload): for each stream, its ledgers newest first, summing their
bytes; a closed ledger not yet offloaded is chosen when the sum passes
``offloadThresholdInBytes`` (the newest N bytes stay local; -1 off) or when it closed at
least ``offloadThresholdInSeconds`` ago (-1 off); chosen ledgers go oldest first. Plain
ledgers go only when asked for by id. The local copy of an offloaded ledger is dropped
``offloadDeletionLagInMillis`` after the offload was verified (plain ledgers:
``managed_ledger_offload_deletion_lag_ms``).

Objects and ledgers: a ledger's offload record (in its metadata) names its objects. When
the ledger is deleted, its objects go and then the record; GC purges the ledger only after
that, so a failure or a crash in between is retried (at start and every run), never
orphaned. Objects that no record names are reported by status and deleted only on request.

Replicated streams (a metadata store): the stream's owner offloads its ledgers, and their
offload records live in the stream's record (node.offload.streams); "the local copy" is then
the replicated ledger, deleted after the lag so that every node reclaims its replica. Their
objects go with a trim or the stream's deletion, named by the ``doomed`` records, which any
node finishes (``FleetStreams``). No node calls an object unknown before it has read every
stream record of the fleet: another node's stream names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

from node.offload.errors import ObjectStoreError, ObjectStoreTimeout, ObjectStoreUnavailable
from node.offload.format import AUDIT_PREFIX, parse_key
from node.offload.multipart import IncompleteUpload
from node.offload.offloader import (
    Ineligible,
    LedgerOffloader,
    LocalLedger,
    OffloadTarget,
    ineligible_reason,
)
from node.offload.reader import OffloadReader
from node.offload.stats import OffloadStats
from node.offload.store import ObjectStore, open_store
from node.offload.streams import StreamLedger, replicated
from node.settings import data_dirs
from node.storage.clock import Clock
from node.storage.errors import InvalidArgument, LedgerNotFound, StorageError
from node.storage.fsutil import usage
from node.storage.index import STREAM_PROPERTY, LedgerMeta, LedgerState, OffloadInfo, OffloadState
from node.storage.ledgers import LedgerStorage
from node.streams import rules
from node.streams.manager import MetadataUnavailable, StreamManager, StreamNotFound
from node.streams.model import LedgerInfo, Stream

log = logging.getLogger(__name__)

MS_PER_S = 1000


@dataclass(slots=True)
class RunResult:
    offloaded: list[int] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)
    local_deleted: list[int] = field(default_factory=list)
    refused: str | None = None  # why nothing was offloaded at all (the store's disk)

    def to_json(self, dry_run: bool) -> dict[str, Any]:
        return {
            "dryRun": dry_run,
            "refused": self.refused,
            "offloaded": self.offloaded,
            "skipped": [{"ledgerId": lid, "reason": why} for lid, why in self.skipped],
            "failed": [{"ledgerId": lid, "error": why} for lid, why in self.failed],
            "localDeleted": self.local_deleted,
        }


class FleetStreams(Protocol):
    """The replicated streams of the whole fleet, as the metadata store holds them
    (node.streams.router), for what one node cannot know alone."""

    async def offloaded_objects(self) -> set[tuple[int, str]]:
        """(ledger id, attempt) of every offload a stream record or a doomed record names."""

    async def finish_deletions(self) -> None:
        """Finish the deletions trims and stream deletions left (ledgers, then objects)."""

    async def take_over_unowned(self) -> list[str]:
        """Take over the streams no live node owns (their lifecycle runs on an owner)."""


class OffloadService:
    """The node's tiered storage (this module's docstring): which ledgers go and when, each
    handed to the LedgerOffloader; the deletion lag, objects of deleted ledgers, status."""

    def __init__(
        self,
        storage: LedgerStorage,
        streams: StreamManager,
        clock: Clock,
        fleet: FleetStreams | None = None,
    ) -> None:
        self._storage = storage
        self._streams = streams
        self._fleet = fleet  # with a metadata store: replicated streams
        self._settings = storage.settings
        self._clock = clock
        self.stats = OffloadStats()
        self._lock = asyncio.Lock()  # one run (or removal of unknown objects) at a time
        self._store: ObjectStore | None = None
        self._reader: OffloadReader | None = None
        self._offloader: LedgerOffloader | None = None
        self.last_run_ms: int | None = None
        self.last_error: str | None = None

    async def start(self) -> None:
        self._store = await open_store(self._settings, self.stats)
        self._reader = OffloadReader(self._store, self._settings, self._clock, self.stats)
        self._offloader = LedgerOffloader(self._store, self._settings, self._clock, self.stats)
        self._storage.set_cold_reader(self._reader)
        self._storage.add_deletion_listener(self._ledger_deleted)
        self._streams.cold = self._reader
        self._streams.remove_objects = self._remove_attempt
        try:
            await self.reap_deleted()
        except Exception as e:  # the store may be down now: the next run retries
            log.warning("could not delete the objects of deleted ledgers yet: %s", e)

    @property
    def store(self) -> ObjectStore:
        if self._store is None:
            raise InvalidArgument("offload is not started")
        return self._store

    @property
    def offloader(self) -> LedgerOffloader:
        if self._offloader is None:
            raise InvalidArgument("offload is not started")
        return self._offloader

    @property
    def reader(self) -> OffloadReader:
        if self._reader is None:
            raise InvalidArgument("offload is not started")
        return self._reader

    # --- deletion of objects with their ledger ---------------------------------------------

    async def _ledger_deleted(self, meta: LedgerMeta) -> None:
        if meta.offload is not None:
            await self._remove_objects(meta)

    async def _remove_objects(self, meta: LedgerMeta) -> None:
        assert meta.offload is not None
        await self.offloader.remove_attempt(meta.ledger_id, meta.offload.attempt)
        self.reader.forget(meta.ledger_id)
        await self._storage.record_offload(meta.ledger_id, None)

    async def _remove_attempt(self, ledger_id: int, attempt: str) -> None:
        """Delete the objects of a replicated stream's ledger (its record is the stream's)."""
        await self.offloader.remove_attempt(ledger_id, attempt)
        self.reader.forget(ledger_id)

    async def reap_deleted(self) -> list[tuple[int, str]]:
        """Objects of deleted ledgers that a failure or a crash left: delete them now.
        Returns the ledgers whose objects must wait (the store failing), with the error."""
        if self._fleet is not None:
            await self._fleet.finish_deletions()  # logs what must wait
        waiting = []
        for meta in list(self._storage.all_ledgers()):
            if meta.state == LedgerState.DELETED and meta.offload is not None:
                try:
                    await self._remove_objects(meta)
                except ObjectStoreError as e:
                    log.warning("ledger %d is deleted; its objects stay for now: %s",
                                meta.ledger_id, e.message)  # fmt: skip
                    waiting.append((meta.ledger_id, e.message))
        return waiting

    # --- runs --------------------------------------------------------------------------------

    async def run(
        self, dry_run: bool = False, stream: str | None = None, ledgers: list[int] | None = None
    ) -> RunResult:
        async with self._lock:
            result = RunResult()
            if not dry_run:
                self.stats.runs += 1
                if self._fleet is not None and stream is None and ledgers is None:
                    await self._fleet.take_over_unowned()  # a run by policy reaches them all
                result.failed.extend(await self.reap_deleted())
            candidates = self._plan(stream, ledgers, result)
            if candidates:
                result.refused = await asyncio.to_thread(self._store_disk_refusal)
            if result.refused is not None:
                log.warning("offload refused: %s", result.refused)
                result.skipped.extend((t.ledger_id, "store_disk_full") for t in candidates)
                candidates = []
            if dry_run:
                result.offloaded = [target.ledger_id for target in candidates]
                result.local_deleted = [m.ledger_id for m in self._local_copies_due()]
                result.local_deleted += [lid for _stream, lid in self._replicas_due()]
                return result
            unreachable: str | None = None
            for target in candidates:
                ledger_id = target.ledger_id
                if unreachable is not None:  # each would wait as long to fail the same way
                    result.skipped.append((ledger_id, "store_unreachable"))
                    continue
                try:
                    await self.offloader.offload(target)
                except Ineligible as e:
                    result.skipped.append((ledger_id, str(e)))
                except LedgerNotFound:
                    # deleted (a stream's deletion, retention) before or during its offload
                    result.skipped.append((ledger_id, "deleted"))
                    log.info("ledger %d was deleted during its offload: skipped", ledger_id)
                except StorageError as e:
                    result.failed.append((ledger_id, e.message))
                    log.error("offload of ledger %d failed: %s", ledger_id, e.message)
                    if isinstance(e, ObjectStoreUnavailable | ObjectStoreTimeout):
                        unreachable = e.message
                else:
                    result.offloaded.append(ledger_id)
            result.local_deleted = await self._delete_local_copies()
            self.last_run_ms = self._clock.now_ms()
            self.last_error = result.failed[-1][1] if result.failed else result.refused
            return result

    def _store_disk_refusal(self) -> str | None:
        """Blocking: why nothing may go to the local store now (None: it may). A local
        store on the data disk takes space rather than freeing it (a local copy stays for
        the deletion lag, and its objects stay after): above the warning watermark,
        offloading would be what fills the disk."""
        s = self._settings
        if s.offload_store != "local":
            return None
        store = os.stat(s.offload_dir).st_dev
        for name, path in data_dirs(s).items():
            made = next(p for p in (path, *path.parents) if p.exists())  # maybe not yet
            if os.stat(made).st_dev != store:
                continue
            used = usage(path)
            if used > s.disk_usage_warn_threshold:
                return (
                    f"the local offload store {s.offload_dir} shares the disk of {name} "
                    f"({path}), which is {used:.1%} full (warning at "
                    f"{s.disk_usage_warn_threshold:.0%}): offloading to it would fill that "
                    "disk, not free it; offload to S3, or free space first"
                )
        return None

    def _plan(
        self, stream: str | None, ledgers: list[int] | None, result: RunResult
    ) -> list[OffloadTarget]:
        if ledgers is not None:
            named = None
            if stream is not None:
                named = {info.ledger_id for info in self._streams.stream(stream).ledgers}
            chosen: list[OffloadTarget] = []
            for ledger_id in ledgers:
                target = self._target(ledger_id)
                try:
                    meta = target.meta()
                except LedgerNotFound:
                    result.skipped.append((ledger_id, "not_found"))
                    continue
                reason = ineligible_reason(meta)
                if named is not None and ledger_id not in named:
                    reason = "not_in_stream"
                if reason is None:
                    chosen.append(target)
                else:
                    result.skipped.append((ledger_id, reason))
            return chosen
        streams = [self._streams.stream(stream)] if stream is not None else self._streams.streams()
        chosen = []
        for s in streams:
            for ledger_id in self.select(s):
                target = self._target(ledger_id, s)
                try:
                    reason = ineligible_reason(target.meta())
                except LedgerNotFound:
                    continue
                if reason is None:
                    chosen.append(target)
                elif reason != "already_offloaded":
                    result.skipped.append((ledger_id, reason))
        return chosen

    def _target(self, ledger_id: int, stream: Stream | None = None) -> OffloadTarget:
        """Where the ledger's offload record lives: its replicated stream's record (the
        stream is looked for among the ones this node owns when not given), else its own
        metadata."""
        if stream is None:
            stream = next(
                (s for s in self._replicated() if any(i.ledger_id == ledger_id for i in s.ledgers)),
                None,
            )
        if stream is not None and replicated(stream):
            return StreamLedger(self._streams, stream.name, ledger_id)
        return LocalLedger(self._storage, ledger_id)

    def _replicated(self) -> list[Stream]:
        return [s for s in self._streams.streams() if replicated(s)]

    def select(self, stream: Stream) -> list[int]:
        """Ledgers of ``stream`` its policies send to the object store, oldest first
        (offloaded ones included): ``rules.offload_candidates`` now."""
        return rules.offload_candidates(stream, self._clock.now_ms())

    def _deletion_lag_ms(self, meta: LedgerMeta) -> int:
        owner_name = meta.properties.get(STREAM_PROPERTY)
        owner = None
        if owner_name is not None:
            with contextlib.suppress(StreamNotFound):
                owner = self._streams.stream(owner_name)
        plain_lag_ms = self._settings.managed_ledger_offload_deletion_lag_ms
        return rules.offload_deletion_lag_ms(owner, plain_lag_ms)

    def _local_copies_due(self) -> list[LedgerMeta]:
        now = self._clock.now_ms()
        due = []
        for meta in self._storage.ledgers():
            at = rules.local_copy_due_ms(meta.offload, self._deletion_lag_ms(meta))
            if at is not None and now >= at:
                due.append(meta)
        return due

    def _replicas_due(self) -> list[tuple[str, int]]:
        """Offloaded ledgers of replicated streams whose replicas the deletion lag let go."""
        now = self._clock.now_ms()
        due = []
        for s in self._replicated():
            lag_ms = s.policies.offloadDeletionLagInMillis
            for info in s.ledgers:
                at = rules.local_copy_due_ms(info.offload, lag_ms)
                if at is not None and now >= at:
                    due.append((s.name, info.ledger_id))
        return due

    async def _delete_local_copies(self) -> list[int]:
        dropped = []
        for stream, ledger_id in self._replicas_due():
            try:
                await self._streams.drop_replicas(stream, ledger_id)
            except StorageError as e:
                log.warning("ledger %d: replicas kept for now: %s", ledger_id, e)
                continue
            self.stats.local_copies_deleted += 1
            dropped.append(ledger_id)
        for meta in self._local_copies_due():
            try:
                await self._storage.drop_local_copy(meta.ledger_id)
            except StorageError as e:
                log.warning("ledger %d: local copy kept for now: %s", meta.ledger_id, e)
                continue
            self.stats.local_copies_deleted += 1
            dropped.append(meta.ledger_id)
        return dropped

    async def run_forever(self) -> None:
        """The in-node scheduler (``offload_scheduler_enabled``)."""
        while True:
            await self._clock.sleep(self._settings.offload_scheduler_interval_s)
            try:
                await self.run()
            except Exception:
                log.exception("offload run failed; trying again at the next interval")

    # --- status and unknown objects ------------------------------------------------------

    async def _known(self) -> set[tuple[int, str]]:
        """Attempts an offload record names: the node's own ledgers', and with a metadata
        store every replicated stream's, whichever node owns it (MetadataUnavailable when
        the store does not answer: then nothing can be called unknown)."""
        known = {
            (meta.ledger_id, meta.offload.attempt)
            for meta in list(self._storage.all_ledgers())
            if meta.offload is not None
        }
        if self._fleet is not None:
            known |= await self._fleet.offloaded_objects()
        return known

    async def unknown_objects(self) -> list[tuple[str, int]]:
        """Objects that no offload record names."""
        # Listed first: an attempt is recorded before its objects are written, so every
        # object listed here whose offload is in flight, on any node, has its record read next.
        found = await self.store.list()
        known = await self._known()
        return [
            (key, size)
            for key, size in found
            if parse_key(key) not in known and not key.startswith(AUDIT_PREFIX)
        ]

    async def incomplete_uploads(self) -> list[IncompleteUpload]:
        """Multipart uploads never completed: a node killed mid-upload (a run in flight
        has one too; status shows it)."""
        found = await self.store.incomplete_uploads()
        return [u for u in found if not u.key.startswith(AUDIT_PREFIX)]

    async def remove_unknown_objects(self) -> dict[str, Any]:
        """Delete the objects no record names and abort every incomplete upload (under the
        run lock: no upload of this node is in flight)."""
        async with self._lock:
            unknown = await self.unknown_objects()
            for key, _size in unknown:
                await self.store.delete(key)
                self.stats.objects_deleted += 1
            aborted = await self.incomplete_uploads()
            for upload in aborted:
                await self.store.abort_upload(upload)
                self.stats.uploads_aborted += 1
            return {
                "removed": [key for key, _size in unknown],
                "abortedUploads": [_upload_json(u) for u in aborted],
            }

    def lag_seconds(self) -> float:
        """Age of the oldest ledger due for offload and not offloaded (0 if none)."""
        now = self._clock.now_ms()
        oldest = [
            info.closed_ms
            for s in self._streams.streams()
            for lid in self.select(s)
            for info in s.ledgers
            if info.ledger_id == lid and not self._is_offloaded(s, info)
        ]
        return max(0.0, (now - min(oldest)) / MS_PER_S) if oldest else 0.0

    def _is_offloaded(self, stream: Stream, info: LedgerInfo) -> bool:
        if replicated(stream):
            offload = info.offload
        else:
            try:
                offload = self._storage.ledger(info.ledger_id).offload
            except LedgerNotFound:
                return True  # gone: nothing to wait for
        return offload is not None and offload.offloaded

    def summary(self) -> dict[str, Any]:
        """Figures per stream (plain ledgers under ``""``) and in total."""
        groups: dict[str, dict[str, Any]] = {}
        now = self._clock.now_ms()

        def group(name: str) -> dict[str, Any]:
            return groups.setdefault(
                name,
                {
                    "offloadedLedgers": 0,
                    "offloadedBytes": 0,
                    "inProgress": 0,
                    "awaitingDeletionBytes": 0,
                    "oldestEligible": None,
                },
            )

        def count(g: dict[str, Any], offload: OffloadInfo, local_bytes: int) -> None:
            if offload.state == OffloadState.IN_PROGRESS:
                g["inProgress"] += 1
            elif offload.offloaded:
                g["offloadedLedgers"] += 1
                g["offloadedBytes"] += offload.data_bytes
                if not offload.local_deleted:
                    g["awaitingDeletionBytes"] += local_bytes

        for s in self._streams.streams():
            g = group(s.name)
            infos = {info.ledger_id: info for info in s.ledgers}
            due = [lid for lid in self.select(s) if not self._is_offloaded(s, infos[lid])]
            if due:
                closed = infos[due[0]].closed_ms
                g["oldestEligible"] = {
                    "ledgerId": due[0],
                    "closedTime": closed,
                    "lagSeconds": max(0.0, (now - closed) / MS_PER_S),
                }
            if replicated(s):  # its records hold the offloads (its replicas: the local copy)
                for info in s.ledgers:
                    if info.offload is not None:
                        count(g, info.offload, info.size_bytes)
        for meta in list(self._storage.ledgers()):
            if meta.offload is not None:
                count(group(meta.properties.get(STREAM_PROPERTY, "")), meta.offload,
                      meta.payload_bytes)  # fmt: skip
        totals = {
            key: sum(g[key] for g in groups.values())
            for key in ("offloadedLedgers", "offloadedBytes", "inProgress", "awaitingDeletionBytes")
        }
        totals["lagSeconds"] = self.lag_seconds()
        return {"streams": groups, "totals": totals}

    async def status(self) -> dict[str, Any]:
        """Everything the node knows; what needs the store (its unknown objects) is null
        with ``storeError`` set while the store fails."""
        unknown: list[dict[str, Any]] | None = None
        uploads: list[dict[str, str]] | None = None
        store_error: dict[str, str] | None = None
        try:
            unknown = [{"key": key, "bytes": size} for key, size in await self.unknown_objects()]
            if self.store.lists_uploads:
                uploads = [_upload_json(u) for u in await self.incomplete_uploads()]
        except (ObjectStoreError, MetadataUnavailable) as e:
            store_error = {"code": e.code, "message": e.message}
        return {
            "store": self.store.description,
            **self.summary(),
            "lastRun": self.last_run_ms,
            "lastError": self.last_error,
            "unknownObjects": unknown,
            "incompleteUploads": uploads,
            "storeError": store_error,
        }


def _upload_json(upload: IncompleteUpload) -> dict[str, str]:
    return {"key": upload.key, "uploadId": upload.upload_id}
