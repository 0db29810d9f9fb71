"""Errors of the storage engine. Each carries a stable code that the HTTP layer returns."""

from __future__ import annotations


class StorageError(Exception):
    code = "storage_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class LedgerNotFound(StorageError):
    code = "ledger_not_found"


class EntryNotFound(StorageError):
    code = "entry_not_found"


class LedgerExists(StorageError):
    """A ledger id that is taken by a ledger with other properties, or a deleted one."""

    code = "ledger_exists"


class LedgerClosed(StorageError):
    code = "ledger_closed"


class LedgerFenced(StorageError):
    code = "ledger_fenced"


class LedgerFull(StorageError):
    """An append would take an entry id past 2^63 - 1: the ledger has no id left for it."""

    code = "ledger_full"


class EntryConflict(StorageError):
    """The same (ledger, entry) was added before with different bytes."""

    code = "entry_conflict"


class ReplicatedLedger(StorageError):
    """A plain add or a local close of a replicated ledger: its writer and the metadata store
    own it (node/client), not this node's routes."""

    code = "replicated_ledger"


class NotReplicated(StorageError):
    """A replica add to a ledger that exists here as a node-local ledger."""

    code = "not_replicated"


class EntryTooLarge(StorageError):
    code = "entry_too_large"


class InvalidArgument(StorageError):
    code = "invalid_argument"


class WriteTokenMismatch(StorageError):
    code = "write_token_mismatch"


class Backpressure(StorageError):
    """The write cache stayed full for maxThrottleTime; the client should retry."""

    code = "backpressure"


class CorruptRecord(StorageError):
    """A record whose CRC, magic or framing does not check out; names the file and offset."""

    code = "corrupt_record"

    def __init__(self, path: str, offset: int, reason: str) -> None:
        super().__init__(f"{path} at offset {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


class StorageIoError(StorageError):
    """A read failed with an I/O error: the entry may well be there. Never an "entry not
    found": a replica that answered absent for an unreadable entry could get a recovery to
    truncate the ledger (BookKeeper #2908)."""

    code = "io_error"


class NodeReadOnly(StorageError):
    """Adds and new ledgers are refused: an operator asked for it, or a disk is full."""

    code = "read_only"


class DiskFull(NodeReadOnly):
    """A data disk is past its full watermark, or a write hit ENOSPC."""

    code = "disk_full"


class StorageClosed(StorageError):
    code = "storage_closed"


class JournalFailed(StorageError):
    """The WAL could not write or fsync; nothing more is acknowledged."""

    code = "journal_failed"


class WalDeviceError(StorageError):
    """The raw-device WAL's device or file cannot be used as configured (too small, a header
    of another capacity, a path that is no device); the message says what to do."""

    code = "wal_device"
