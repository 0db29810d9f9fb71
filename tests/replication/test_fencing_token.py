"""Fencing reads on nodes with an admin token: etcd and three real node
processes with NODE_ADMIN_TOKEN. A fencing read is a state change: without the token it
fences no live ledger and creates no ledger of an unknown id; the client, given the token,
still recovers a ledger (its fencing reads carry it)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from node.client import AddOutcomeUnknown, Client, LedgerFencedError
from node.client.metadata.store import LEDGER_ID_BASE
from tests.harness.cluster import MakeCluster

TOKEN = "fleet-admin-s3cret"
UNKNOWN_READS = 200  # fencing reads of ids nobody created, per node (the issue sent 5,000)


async def _status(session: aiohttp.ClientSession, url: str, **headers: str) -> tuple[int, Any]:
    async with session.get(url, headers=headers) as response:
        return response.status, await response.json()


async def _ledgers(session: aiohttp.ClientSession, url: str) -> list[tuple[int, str]]:
    status, body = await _status(session, f"{url}/api/v1/ledgers")  # a read: no token
    assert status == 200, body
    return [(m["ledgerId"], m["state"]) for m in body["ledgers"]]


async def test_only_the_token_fences_and_recovery_still_works(make_cluster: MakeCluster) -> None:
    cluster = await asyncio.to_thread(make_cluster, 3, None, {"NODE_ADMIN_TOKEN": TOKEN})
    urls = [cluster.url(node_id) for node_id in cluster.node_ids]
    async with (
        Client(cluster.metadata_url, token=TOKEN) as writer_client,
        aiohttp.ClientSession() as anonymous,
    ):
        ledger = await writer_client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        acknowledged = [b"entry-%d" % i for i in range(5)]
        await ledger.add_batch(acknowledged)
        before = {url: await _ledgers(anonymous, url) for url in urls}
        assert all(held == [(ledger.id, "open")] for held in before.values()), before
        unknown = [LEDGER_ID_BASE + 10**9 + i for i in range(UNKNOWN_READS)]
        for url in urls:
            for lid in [ledger.id, *unknown]:
                for path in ("lac?replicated=1&fence=1", "entries/0?fence=1"):
                    target = f"{url}/api/v1/ledgers/{lid}/{path}"
                    status, body = await _status(anonymous, target)
                    assert (status, body.get("code")) == (401, "unauthorized"), (target, body)
                    if lid == ledger.id:
                        status, body = await _status(
                            anonymous, target, Authorization="Bearer not-the-token"
                        )
                        assert (status, body.get("code")) == (403, "forbidden"), (target, body)
        # Nothing changed: no ledger made, the live one not fenced, its writer goes on.
        assert {url: await _ledgers(anonymous, url) for url in urls} == before
        acknowledged.append(b"after the refused fences")
        assert await ledger.add(acknowledged[-1]) == len(acknowledged) - 1

        # The token's holder recovers it: its fencing reads pass, the writer is fenced.
        async with Client(cluster.metadata_url, token=TOKEN) as recoverer:
            reader = await recoverer.open_ledger(ledger.id, recover=True)
            assert [p async for _, p in reader.read(0, reader.last_entry_id)] == acknowledged
            metadata = await recoverer.ledger_metadata(ledger.id)
        assert (metadata["state"], metadata["lastEntryId"]) == ("CLOSED", len(acknowledged) - 1)
        with pytest.raises(AddOutcomeUnknown):
            await ledger.add(b"after the fence")
        with pytest.raises(LedgerFencedError):
            await ledger.close()
        for url in urls:
            assert await _ledgers(anonymous, url) == [(ledger.id, "fenced")]
