"""Replicated ledgers across SIGKILL, against the node as a real process: writers send
replica adds of stripes (single entries, batches, ranges) with rising X-Lac, a recovery
fences some ledgers mid-way (LAC and entry reads with fence=1, an unknown ledger too), and
the node is killed at a random moment. After the restart every acknowledged entry reads
back byte for byte, every ledger is still replicated, every fence holds, no writer LAC
came back higher than one the writers sent, and no id a fencing read called absent is
there."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from node.client import protocol
from tests.harness.clients import REPLY_LOST, http_status
from tests.harness.node import DEFAULT_SETTINGS, NodeProcess

LID = 1 << 62
LEDGERS = 4
NODE = "crash-replica"
TRIALS = 3


@dataclass
class Seen:
    """What the node acknowledged and answered: the checker's model."""

    entries: dict[tuple[int, int], bytes] = field(default_factory=dict)
    lac_sent: dict[int, int] = field(default_factory=dict)  # highest X-Lac sent, per ledger
    fenced: set[int] = field(default_factory=set)
    absent: set[tuple[int, int]] = field(default_factory=set)  # a fencing read's 404


def _headers(first: int, lac: int, content_type: str) -> dict[str, str]:
    return {
        "Content-Type": content_type,
        protocol.REPLICATED_HEADER: "3/2/2",
        protocol.ENTRY_ID_HEADER: str(first),
        protocol.LAC_HEADER: str(lac),
        protocol.LAC_LENGTH_HEADER: str(max(lac, 0) * 100),
        protocol.EXPECT_NODE_HEADER: NODE,
    }


async def _writer(
    session: aiohttp.ClientSession, url: str, rng: random.Random, ledger: int, seen: Seen
) -> None:
    """A stripe of E=3, Qw=2 (ids with id % 3 != 2) until the node dies or fences it."""
    next_id = 0
    while True:
        ids: list[int] = []
        while len(ids) < rng.choice((1, 1, 3, 6)):
            if next_id % 3 != 2:
                ids.append(next_id)
            next_id += 1
        entries = [(eid, rng.randbytes(rng.randint(1, 3000))) for eid in ids]
        lac = ids[0] - 1
        seen.lac_sent[ledger] = max(seen.lac_sent.get(ledger, -1), lac)  # sent, maybe applied
        if len(ids) == 1:
            body, kind = entries[0][1], protocol.OCTET_CONTENT_TYPE
        elif ids[-1] - ids[0] == len(ids) - 1:
            body, kind = protocol.encode_batch(p for _e, p in entries), protocol.BATCH_CONTENT_TYPE
        else:
            body, kind = protocol.encode_range(entries), protocol.RANGE_CONTENT_TYPE
        try:
            async with session.post(
                f"{url}/api/v1/ledgers/{ledger}/entries",
                data=body,
                headers=_headers(ids[0], lac, kind),
            ) as r:
                answer = await r.json()
                if r.status == 409 and answer["code"] == protocol.LEDGER_FENCED:
                    return
                assert r.status == 201, answer
                assert r.headers[protocol.NODE_ID_HEADER] == NODE
                assert (answer["firstEntryId"], answer["lastEntryId"]) == (ids[0], ids[-1])
        except REPLY_LOST:
            return
        for eid, payload in entries:
            seen.entries[(ledger, eid)] = payload


async def _recovery(
    session: aiohttp.ClientSession, url: str, rng: random.Random, seen: Seen, base: int
) -> None:
    """Fence two of the ledgers and an unknown one, by LAC and entry reads."""
    await asyncio.sleep(rng.uniform(0.1, 0.4))
    try:
        for ledger in (base, base + 1, base + 99):
            async with session.get(f"{url}/api/v1/ledgers/{ledger}/lac?replicated=1&fence=1") as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["fenced"] is True
            seen.fenced.add(ledger)
            for eid in rng.sample(range(300), 20):
                async with session.get(f"{url}/api/v1/ledgers/{ledger}/entries/{eid}?fence=1") as r:
                    if r.status == 404:
                        assert (await r.json())["code"] == protocol.ENTRY_NOT_FOUND
                        seen.absent.add((ledger, eid))
                    else:
                        assert r.status == 200, await r.text()
    except REPLY_LOST:
        return


async def _workload(node: NodeProcess, rng: random.Random, seen: Seen, base: int) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        tasks = [
            asyncio.ensure_future(_writer(session, node.url, rng, base + n, seen))
            for n in range(LEDGERS)
        ]
        tasks.append(asyncio.ensure_future(_recovery(session, node.url, rng, seen, base)))
        await asyncio.sleep(rng.uniform(0.3, 1.2))
        await asyncio.to_thread(node.kill)
        await asyncio.gather(*tasks)


def _check(node: NodeProcess, seen: Seen) -> int:
    """Check what the node holds against ``seen``; the highest writer LAC it reports."""
    highest = -1
    for (ledger, eid), payload in seen.entries.items():
        assert node.get_bytes(f"/api/v1/ledgers/{ledger}/entries/{eid}") == payload, (ledger, eid)
    for ledger, eid in seen.absent:
        # Refused after the fence (its add never acknowledged), so still absent.
        assert (ledger, eid) not in seen.entries
        assert http_status(node, f"/api/v1/ledgers/{ledger}/entries/{eid}") == 404
    for ledger in {*seen.lac_sent, *seen.fenced}:
        path = f"/api/v1/ledgers/{ledger}/lac?replicated=1"
        if http_status(node, path) == 404:  # its first add died with the node
            assert ledger not in seen.fenced
            assert not any(lid == ledger for lid, _eid in seen.entries), ledger
            continue
        view = node.get_json(path)
        assert view["lac"] <= seen.lac_sent.get(ledger, -1), (ledger, view)
        highest = max(highest, view["lac"])
        if ledger in seen.fenced:  # (a fence whose answer the kill took may hold, or not)
            assert view["fenced"] is True, (ledger, view)
    return highest


@pytest.mark.parametrize("defaults", [False, True], ids=["churn", "defaults"])
def test_replicas_survive_sigkill(tmp_path: Path, defaults: bool) -> None:
    rng = random.Random(2614)
    env = {"NODE_ID": NODE, **(DEFAULT_SETTINGS if defaults else {})}
    node = NodeProcess(tmp_path / "data", env=env)
    seen = Seen()
    for trial in range(TRIALS):
        node.start()
        _check(node, seen)  # what every earlier trial left, after one more restart
        before = len(seen.entries)
        # Fresh ledgers each trial: the earlier ones may be fenced.
        asyncio.run(_workload(node, rng, seen, LID + trial * 1000))
        assert len(seen.entries) > before, "no add was acknowledged before the kill"
    node.start()
    highest = _check(node, seen)
    assert seen.absent and seen.fenced, "the recovery never ran before a kill"
    if not defaults:  # checkpoints every 100 ms: the writers' LACs of the last one survive
        assert highest >= 0, "no writer LAC survived the kills"
    node.terminate()
