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
