"""The client's errors. A caller tells "not done" from "maybe done" by the class: an
OutcomeUnknown is never a subclass of a failure that means "not written"."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from node.client.protocol import LEDGER_FENCED, LEDGER_NOT_FOUND, NOT_FOUND_CODES

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


class NoSuchLedger(MetadataError):
    """No ledger under this id (never created, or deleted)."""

    def __init__(self, ledger_id: int) -> None:
        super().__init__(f"ledger {ledger_id}: no such ledger")
        self.ledger_id = ledger_id


class NotEnoughNodes(ClientError):
    """Fewer writable registered nodes than an ensemble needs."""


class LedgerClosedError(ClientError):
    """The handle is closed (or unusable): nothing was sent."""


class LedgerClosedElsewhere(ClientError):
    """The ledger was closed by someone else at another end than this writer's."""


class LedgerFencedError(ClientError):
    """A recovery took the ledger from this writer (fenced, or IN_RECOVERY in the metadata)."""


class RecoveryFailed(ClientError):
    """Recovery could not decide the ledger's end (an unknown answer, a timeout, too few
    replicas): the ledger stays IN_RECOVERY and a rerun resumes it."""


class AddFailed(ClientError):
    """An add that was never sent to any node: it is not written."""


class AddOutcomeUnknown(ClientError):
    """An add that was sent but not acknowledged: it may be in the ledger or not (a recovery
    decides). Never a subclass of AddFailed. ``reason``: fenced, closed, in_recovery,
    no_replacement, ensemble_changes, unauthorized (a node refused the client's admin token),
    client_closed (the client closed with the add in flight)."""

    def __init__(self, entry_id: int, reason: str) -> None:
        super().__init__(f"entry {entry_id}: outcome unknown ({reason})")
        self.entry_id = entry_id
        self.reason = reason


class ReadFailed(ClientError):
    """No replica of an entry's write set returned it."""


class ReplicaError(ClientError):
    """A node's answer other than success. Only ``absent`` (the JSON code says the index has no
    such entry or ledger) means "not there"; ``fenced`` is a recovery's fence; everything else
    (other codes, 5xx, timeouts, connection errors) is unknown."""

    def __init__(self, node_id: str, code: str, status: int = 0, message: str = "") -> None:
        super().__init__(f"node {node_id}: {code} ({status}) {message}".rstrip())
        self.node_id = node_id
        self.code = code
        self.status = status

    @property
    def absent(self) -> bool:
        return self.code in NOT_FOUND_CODES

    @property
    def fenced(self) -> bool:
        return self.code == LEDGER_FENCED


def error_code(error: BaseException) -> str:
    """A stable code for an error of the client: its class name in snake case
    (StoreUnavailable -> store_unavailable), or the code it carries."""
    if isinstance(error, NoSuchLedger):
        return LEDGER_NOT_FOUND
    code = getattr(error, "code", None)
    if isinstance(code, str):
        return code
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower()
