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
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import obstore
from obstore.exceptions import NotFoundError
from obstore.store import LocalStore, S3Store

from node.settings import MiB, Settings

if TYPE_CHECKING:
    from obstore.store import ObjectStore as ObstoreStore

S3_MIN_PART = 5 * MiB  # S3 refuses smaller parts of a multipart upload (but the last)
# obstore reports a missing object as its NotFoundError, or (local store) FileNotFoundError
NOT_FOUND = (NotFoundError, FileNotFoundError)
UPLOAD_CONCURRENCY = 2  # parts in flight (Pulsar: managedLedgerOffloadMaxThreads = 2)


class ObjectMissing(Exception):
    """The object does not exist."""


class ObjectStore:
    """The few operations offload needs, over one obstore store."""

    def __init__(self, store: ObstoreStore, description: str) -> None:
        self._store = store
        self.description = description

    async def put_multipart(self, key: str, parts: AsyncIterator[bytes], part_size: int) -> None:
        """One object from ``parts`` in a multipart upload; all of it or, on an error
        (of the store or of ``parts``), none (the upload is aborted)."""
        await obstore.put_async(
            self._store,
            key,
            parts,
            use_multipart=True,
            chunk_size=max(part_size, S3_MIN_PART),
            max_concurrency=UPLOAD_CONCURRENCY,
        )

    async def put(self, key: str, data: bytes) -> None:
        await obstore.put_async(self._store, key, data, use_multipart=False)

    async def get(self, key: str) -> bytes:
        try:
            result = await obstore.get_async(self._store, key)
            return bytes(await result.bytes_async())
        except NOT_FOUND as e:
            raise ObjectMissing(key) from e

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            data = await obstore.get_range_async(self._store, key, start=start, length=length)
        except NOT_FOUND as e:
            raise ObjectMissing(key) from e
        return bytes(data)

    async def size(self, key: str) -> int | None:
        try:
            meta = await obstore.head_async(self._store, key)
        except NOT_FOUND:
            return None
        return int(meta["size"])

    async def delete(self, key: str) -> None:
        """Delete ``key``; an object that is not there is fine (deletes are retried)."""
        with contextlib.suppress(*NOT_FOUND):
            await obstore.delete_async(self._store, key)

    async def list(self, prefix: str | None = None) -> list[tuple[str, int]]:
        """(key, size) of every object (under ``prefix``)."""
        found: list[tuple[str, int]] = []
        async for chunk in obstore.list(self._store, prefix):
            found.extend((meta["path"], int(meta["size"])) for meta in chunk)
        return found


async def open_store(settings: Settings) -> ObjectStore:
    """The store the settings name (the local directory is created on a worker thread)."""
    if settings.offload_store == "local":
        root = settings.offload_dir
        if settings.offload_prefix:
            root = root / settings.offload_prefix
        local = await asyncio.to_thread(LocalStore, root, mkdir=True)
        return ObjectStore(local, f"local:{root}")
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
    return ObjectStore(s3, f"s3://{settings.offload_bucket}{prefix}")
