"""Decommission (BookKeeper's ``decommissionbookie``): mark a node so that the auditor marks
every ledger that names it and the workers move its fragments elsewhere; the node may go once
``still_needed`` is empty. The node may be alive (a scale-down) or gone for good (a lost volume):
either way no replacement is ever chosen on it while it is marked.

Its own copies stay on its disk until their ledgers are deleted: nothing reads them any more,
and the volume goes with the node."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

from node.autorecovery import markers as m
from node.client.errors import CasConflict, NoSuchKey
from node.client.model import LEDGERS_PREFIX, decode

if TYPE_CHECKING:
    from node.client.client import Client


async def decommission(client: Client, node_id: str) -> None:
    """Write ``decommissioning/<node>`` (already there: kept, with its first time)."""
    with contextlib.suppress(CasConflict):
        await client.store.create(
            m.decommissioning_key(node_id), m.encode_since(int(time.time() * 1000))
        )


async def recommission(client: Client, node_id: str) -> bool:
    """Remove ``decommissioning/<node>`` (a decommission started by mistake, or a node kept
    after all): new ensembles may choose it again. Whether there was a mark. What was already
    moved stays moved; markers the auditor wrote for it are re-examined at the next audit,
    which no longer counts the node as leaving (it drops them unless the node is lost)."""
    key = m.decommissioning_key(node_id)
    while True:
        found = await client.store.get(key)
        if found is None:
            return False
        try:
            await client.store.delete(key, found.revision)
            return True
        except (CasConflict, NoSuchKey):
            continue  # changed or gone meanwhile: look again


async def still_needed(client: Client, node_id: str) -> list[int]:
    """The ledgers (ascending ids) with a segment whose ensemble names ``node_id``."""
    needed = []
    for _key, versioned in await client.store.range(LEDGERS_PREFIX):
        meta = decode(versioned.value)
        if any(node_id in segment.ensemble for segment in meta.segments):
            needed.append(meta.ledger_id)
    return needed
