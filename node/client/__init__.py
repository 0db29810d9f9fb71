"""The client library of replicated ledgers (BookKeeper's client, over etcd): it runs in the
caller's process and imports nothing of the node's engine, so scripts and other venvs can use it.

    async with Client("etcd://127.0.0.1:2379/storage") as client:
        ledger = await client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        entry_id = await ledger.add(b"payload")
        first, last = await ledger.add_batch([b"a", b"b"])
        await ledger.close()
        reader = await client.open_ledger(ledger.id, recover=True)
        async for entry_id, payload in reader.read(0, reader.last_entry_id): ...
        metadata = await client.ledger_metadata(ledger.id)
        await client.delete_ledger(ledger.id)

Timeouts and limits are keyword arguments of Client (defaults in node/client/client.py)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from node.client.client import Client as Client
    from node.client.errors import (
        AddFailed as AddFailed,
    )
    from node.client.errors import (
        AddOutcomeUnknown as AddOutcomeUnknown,
    )
    from node.client.errors import (
        ClientError as ClientError,
    )
    from node.client.errors import (
        LedgerClosedElsewhere as LedgerClosedElsewhere,
    )
    from node.client.errors import (
        LedgerClosedError as LedgerClosedError,
    )
    from node.client.errors import (
        LedgerFencedError as LedgerFencedError,
    )
    from node.client.errors import (
        MetadataError as MetadataError,
    )
    from node.client.errors import (
        NoSuchLedger as NoSuchLedger,
    )
    from node.client.errors import (
        NotEnoughNodes as NotEnoughNodes,
    )
    from node.client.errors import (
        ReadFailed as ReadFailed,
    )
    from node.client.errors import (
        RecoveryFailed as RecoveryFailed,
    )
    from node.client.errors import (
        ReplicaError as ReplicaError,
    )
    from node.client.reader import ReadHandle as ReadHandle
    from node.client.writer import LedgerHandle as LedgerHandle

# Loaded on first use: the node imports node.client.protocol on every start, and should not
# pay for the writer, reader and recovery it never runs without a metadata store.
_EXPORTS = {
    "AddFailed": "node.client.errors",
    "AddOutcomeUnknown": "node.client.errors",
    "Client": "node.client.client",
    "ClientError": "node.client.errors",
    "LedgerClosedElsewhere": "node.client.errors",
    "LedgerClosedError": "node.client.errors",
    "LedgerFencedError": "node.client.errors",
    "LedgerHandle": "node.client.writer",
    "MetadataError": "node.client.errors",
    "NoSuchLedger": "node.client.errors",
    "NotEnoughNodes": "node.client.errors",
    "ReadFailed": "node.client.errors",
    "ReadHandle": "node.client.reader",
    "RecoveryFailed": "node.client.errors",
    "ReplicaError": "node.client.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
