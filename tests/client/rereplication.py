"""A re-replication racing a recovery: the autorecovery worker run from a recovery's phase hook,
for a node marked lost beforehand (as the auditor marks it)."""

from __future__ import annotations

from typing import Any

from node.autorecovery import markers
from node.autorecovery.worker import ReplicationResult, rereplicate
from node.client import Client
from node.client.recovery import PhaseHook

LOCK_TTL_S = 60  # outlives the copy of a test's fragment


async def mark_lost(client: Client, ledger_id: int, node: str, created_ms: int = 0) -> None:
    marker = markers.Marker(ledger_id, {node: markers.Reason.LOST}, created_ms)
    await client.store.create(markers.marker_key(ledger_id), marker.encode())


def rereplicate_at(
    phase: str, client: Client, ledger_id: int
) -> tuple[PhaseHook, list[ReplicationResult]]:
    """A hook that runs the worker on the ledger's marker at ``phase``, and its results."""
    results: list[ReplicationResult] = []

    async def hook(at: str, info: dict[str, Any]) -> None:
        if at == phase:
            results.append(
                await rereplicate(
                    client,
                    ledger_id,
                    worker_id="test",
                    open_ledger_grace_s=0,
                    lock_ttl_s=LOCK_TTL_S,
                )
            )

    return hook, results
