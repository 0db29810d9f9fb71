"""The client's errors. A caller tells "not done" from "maybe done" by the class: an
OutcomeUnknown is never a subclass of a failure that means "not written"."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node.client.metadata.store import Versioned


class ClientError(Exception):
    """Every error of node.client."""


class MetadataUrlError(ClientError, ValueError):
    """A metadata store URL that cannot be used (scheme, host, port, prefix)."""


class MetadataError(ClientError):
    """The metadata store refused or could not answer a request."""


class StoreUnavailable(MetadataError):
    """No endpoint answered; nothing was changed (reads, or writes never sent)."""


class OutcomeUnknown(MetadataError):
    """A change was sent but its answer was lost: it may or may not have applied. Re-read to
    know (the CAS loop does)."""


class RequestRefused(MetadataError):
    """The store answered with a definite refusal (a malformed request, an unknown lease):
    nothing was changed. ``code`` is the gRPC status code of etcd's answer."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class CasConflict(MetadataError):
    """A conditional change found another revision than the one it expected (or, for a
    create, a key that exists). ``current`` is what the store holds now, when it said."""

    def __init__(self, key: str, current: Versioned | None = None) -> None:
        super().__init__(
            f"{key}: changed concurrently (now at revision "
            f"{current.revision if current else 'unknown'})"
        )
        self.key = key
        self.current = current


class NoSuchKey(MetadataError):
    """A key that a change expected is absent (deleted, or never created)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"{key}: no such key")
        self.key = key
