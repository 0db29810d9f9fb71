"""The object store under offload: any S3-compatible service, or a local directory (the
embedded default, ``<data dir>/offload``), through obstore's async API (its own runtime
does the I/O: nothing blocks the event loop).

S3 settings: ``offload_bucket``, ``offload_prefix``, ``offload_endpoint`` (any
S3-compatible service; ``http://`` is allowed for MinIO or moto on loopback),
``offload_region``, ``offload_access_key_id`` / ``offload_secret_access_key``; what they
leave empty comes from the standard ``AWS_*`` variables, as the AWS SDKs read them.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import obstore
from obstore import exceptions as obstore_errors
from obstore.exceptions import NotFoundError
from obstore.store import LocalStore, S3Store

from node.offload.errors import ObjectStoreError, ObjectStoreTimeout, ObjectStoreUnavailable
from node.offload.multipart import IncompleteUpload, LocalUploads, S3Uploads, Uploads
from node.offload.stats import OffloadStats
from node.settings import MiB, Settings

if TYPE_CHECKING:
    from obstore.store import ObjectStore as ObstoreStore

S3_MIN_PART = 5 * MiB  # S3 refuses smaller parts of a multipart upload (but the last)
# obstore reports a missing object as its NotFoundError, or (local store) FileNotFoundError
NOT_FOUND = (NotFoundError, FileNotFoundError)
# What obstore's messages say for a ranged read past the end (S3, local), and for a store
# that sheds load
RANGE_NOT_SATISFIABLE = ("status code: 416", "InvalidRange")
UNAVAILABLE = "status code: 503"
UPLOAD_CONCURRENCY = 2  # parts in flight (Pulsar: managedLedgerOffloadMaxThreads = 2)


class ObjectMissing(Exception):
    """The object does not exist."""

    def __init__(self, key: str) -> None:
        super().__init__(f"object {key} does not exist")


class ObjectTooShort(Exception):
    """A ranged read past the object's end (S3: 416): the object is shorter than its index
    says, so it is damaged, not the store failing."""


class ObjectStore:
    """The few operations offload needs, over one obstore store. Every call but an upload
    (bounded per request by the client's ``offload_request_timeout_s``) is bounded by
    ``offload_operation_timeout_s``; a store failure is an ``ObjectStoreError`` naming the
    store, the operation and the object, counted in ``stats.store_errors``."""

    def __init__(
        self,
        store: ObstoreStore,
        description: str,
        timeout_s: float,
        stats: OffloadStats,
        uploads: Uploads,
    ) -> None:
        self._store = store
        self.description = description
        self._timeout_s = timeout_s
        self._stats = stats
        self._uploads = uploads

    @contextlib.asynccontextmanager
    async def _call(self, operation: str, key: str, bounded: bool = True) -> AsyncIterator[None]:
        """Run one store call: its errors mapped (a missing object stays a NOT_FOUND)."""
        try:
            if bounded:
                async with asyncio.timeout(self._timeout_s):
                    yield
            else:
                yield
        except NOT_FOUND:
            raise
        except TimeoutError as e:
            raise self._failed(
                ObjectStoreTimeout, operation, key, f"no answer within {self._timeout_s:g} s"
            ) from e
        except (obstore_errors.BaseError, OSError) as e:
            # obstore tells the kinds apart only in its message (one GenericError for all).
            text = str(e)
            detail = text.split("\n", 1)[0]  # not the debug dump that follows
            if any(marker in text for marker in RANGE_NOT_SATISFIABLE):
                raise ObjectTooShort(f"{key}: {detail}") from e
            if "kind: Timeout" in text:
                raise self._failed(ObjectStoreTimeout, operation, key, detail) from e
            if "kind: Connect" in text or UNAVAILABLE in text or isinstance(e, ConnectionError):
                raise self._failed(ObjectStoreUnavailable, operation, key, detail) from e
            raise self._failed(ObjectStoreError, operation, key, detail) from e

    def _failed(
        self, kind: type[ObjectStoreError], operation: str, key: str, detail: str
    ) -> ObjectStoreError:
        counted = (operation, kind.code)
        self._stats.store_errors[counted] = self._stats.store_errors.get(counted, 0) + 1
        return kind(f"object store {self.description}: {operation} {key!r} failed: {detail}")

    async def put_multipart(self, key: str, parts: AsyncIterator[bytes], part_size: int) -> None:
        """One object from ``parts`` in a multipart upload; all of it or, on an error
        (of the store or of ``parts``), none (the upload is aborted)."""
        async with self._call("put_multipart", key, bounded=False):
            await obstore.put_async(
                self._store,
                key,
                parts,
                use_multipart=True,
                chunk_size=max(part_size, S3_MIN_PART),
                max_concurrency=UPLOAD_CONCURRENCY,
            )

    async def put(self, key: str, data: bytes) -> None:
        async with self._call("put", key, bounded=False):  # as big as an audit snapshot
            await obstore.put_async(self._store, key, data, use_multipart=False)

    async def get(self, key: str) -> bytes:
        try:
            async with self._call("get", key):
                result = await obstore.get_async(self._store, key)
                return bytes(await result.bytes_async())
        except NOT_FOUND as e:
            raise ObjectMissing(key) from e

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            async with self._call("get_range", key):
                data = await obstore.get_range_async(self._store, key, start=start, length=length)
        except NOT_FOUND as e:
            raise ObjectMissing(key) from e
        return bytes(data)

    async def size(self, key: str) -> int | None:
        try:
            async with self._call("head", key):
                meta = await obstore.head_async(self._store, key)
        except NOT_FOUND:
            return None
        return int(meta["size"])

    async def delete(self, key: str) -> None:
        """Delete ``key``; an object that is not there is fine (deletes are retried)."""
        with contextlib.suppress(*NOT_FOUND):
            async with self._call("delete", key):
                await obstore.delete_async(self._store, key)

    async def list(self, prefix: str | None = None) -> list[tuple[str, int]]:
        """(key, size) of every object (under ``prefix``); each page bounded."""
        found: list[tuple[str, int]] = []
        pages = obstore.list(self._store, prefix)
        while True:
            async with self._call("list", prefix or ""):
                chunk = await anext(pages, None)
            if chunk is None:
                return found
            found.extend((meta["path"], int(meta["size"])) for meta in chunk)

    @property
    def lists_uploads(self) -> bool:
        """Whether incomplete multipart uploads can be listed (S3: static credentials)."""
        return self._uploads.available

    async def incomplete_uploads(self, prefix: str = "") -> builtins.list[IncompleteUpload]:
        """Multipart uploads begun and never completed nor aborted (a node killed)."""
        if not self._uploads.available:
            return []
        async with self._call("list_uploads", prefix):
            return await self._uploads.find(prefix)

    async def abort_upload(self, upload: IncompleteUpload) -> None:
        async with self._call("abort_upload", upload.key):
            await self._uploads.abort(upload)


async def open_store(settings: Settings, stats: OffloadStats) -> ObjectStore:
    """The store the settings name (the local directory is created on a worker thread)."""
    if settings.offload_store == "local":
        root = settings.offload_dir
        if settings.offload_prefix:
            root = root / settings.offload_prefix
        local = await asyncio.to_thread(LocalStore, root, mkdir=True)
        timeout_s = settings.offload_operation_timeout_s
        return ObjectStore(local, f"local:{root}", timeout_s, stats, LocalUploads(root))
    config: dict[str, Any] = {
        "virtual_hosted_style_request": settings.offload_virtual_hosted_style,
    }
    if settings.offload_endpoint:
        config["endpoint"] = settings.offload_endpoint
    if settings.offload_region:
        config["region"] = settings.offload_region
    if settings.offload_access_key_id:
        config["access_key_id"] = settings.offload_access_key_id
    if settings.offload_secret_access_key is not None:
        config["secret_access_key"] = settings.offload_secret_access_key.get_secret_value()
    timeout = timedelta(seconds=settings.offload_request_timeout_s)
    s3 = S3Store(
        settings.offload_bucket,
        prefix=settings.offload_prefix or None,
        client_options={
            "allow_http": settings.offload_endpoint.startswith("http://"),
            "timeout": timeout,
        },
        retry_config={
            "max_retries": settings.offload_max_retries,
            "retry_timeout": timeout,
            "backoff": {
                "init_backoff": timedelta(milliseconds=100),
                "max_backoff": timedelta(seconds=5),
                "base": 2,
            },
        },
        **config,
    )
    prefix = f"/{settings.offload_prefix}" if settings.offload_prefix else ""
    description = f"s3://{settings.offload_bucket}{prefix}"
    timeout_s = settings.offload_operation_timeout_s
    uploads = await asyncio.to_thread(S3Uploads, settings)
    return ObjectStore(s3, description, timeout_s, stats, uploads)
