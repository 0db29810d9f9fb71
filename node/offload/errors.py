"""Errors of offload, with stable codes for the HTTP layer."""

from __future__ import annotations

from node.storage.errors import StorageError


class OffloadObjectUnreadable(StorageError):
    """An offloaded object is missing or fails its checks: the read is refused (never
    wrong bytes); the message names the object."""

    code = "offload_object_unreadable"


class OffloadFailed(StorageError):
    """An upload or its verification failed; nothing local was deleted."""

    code = "offload_failed"


class ObjectStoreError(StorageError):
    """The object store failed an operation (an error status, a broken connection); the
    message names the store, the operation and the object. Never a sign of wrong bytes."""

    code = "offload_store_error"


class ObjectStoreUnavailable(ObjectStoreError):
    """The object store could not be reached (refused or dropped connections)."""

    code = "offload_store_unavailable"


class ObjectStoreTimeout(ObjectStoreError):
    """The object store did not answer within ``offload_operation_timeout_s``."""

    code = "offload_store_timeout"
