"""Replicated streams on etcd and four real node processes, through plain HTTP only: writers
(node/jepsen/streams.py's workload) append through any node, a fresh cursor reads the whole
stream back at the end, and the stream checker compares it with the history: every
acknowledged append exactly once, where it was acknowledged, in order; nothing failed, nothing
twice, nothing invented. The faults: the owner SIGKILLed while appends are in flight; the
owner SIGSTOPped past its lease while another node takes over, then resumed; two nodes taking
over at once; rollover, retention, message TTL and offload across a takeover; retention runs
racing for a stream nobody owns; and the stream's deletion, which must leave nothing on any
node, in etcd or in the object store.

The owner's lease is short here (conftest.py: OWNER_TTL_S), so a takeover comes within
seconds of a loss."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from node.client import Client
from node.jepsen.checker import Verdict
from node.jepsen.history import Op, merge
from node.jepsen.streams import StreamWorkload, check_stream, check_stream_ledgers, read_back
from node.localcluster import LocalCluster
from tests.harness.cluster import MakeCluster
from tests.harness.streams import (
    REPLICATED,
    call,
    etcd_get,
    etcd_keys,
    ledger_leftovers,
    leftovers,
    node_ledger_ids,
    owner,
    put_stream,
    stream_ledgers,
    stream_record,
    wait_owner,
)
from tests.streams.conftest import NODES, OWNER_TTL_S, STREAM_CLUSTER_ENV

STREAM = "orders"
ROLLOVER = {"maxEntriesPerLedger": 20, "minLedgerRolloverTimeMinutes": 0}
# The kill test's ledgers roll over every few entries, so that the kill often lands inside a
# rollover (the record already names the next ledger, the last one's close is under way).
KILL_ROLLOVER = {"maxEntriesPerLedger": 4, "minLedgerRolloverTimeMinutes": 0}
TAKEOVER_TIMEOUT_S = 90.0  # a lease's end, a fencing recovery and a new ledger: well within
RACED_STREAMS = 3  # streams two nodes take over at once, in one race each
GONE_TIMEOUT_S = 60.0  # for every node's GC sweep to reclaim a deleted stream's replicas
# Offload with no threshold and no deletion lag: every closed ledger goes, and its replicas
# right after.
OFFLOAD_NOW = {"offloadThresholdInBytes": 0, "offloadDeletionLagInMillis": 0}


async def create(cluster: LocalCluster, via: str, name: str, **policies: int) -> None:
    status, body = await put_stream(cluster.url(via), name, {"replication": REPLICATED, **policies})
    assert status == 201, (status, body)
    record = await stream_record(cluster, name)
    assert record is not None and record["replication"] == REPLICATED, record


def clean(history: list[Op], read: list[tuple[str, bytes]]) -> Verdict:
    verdict = check_stream(history, read)
    assert verdict.ok, str(verdict)
    return verdict


async def clean_replicas(
    cluster: LocalCluster, history: list[Op], read: list[tuple[str, bytes]], name: str
) -> None:
    """The replicated ledgers' checker on every closed ledger of the stream's record."""
    closed = {info["id"] for info in await stream_ledgers(cluster, name) if info["closed"]}
    assert closed
    verdict = await check_stream_ledgers(history, read, cluster.metadata_url, closed)
    assert verdict.ok, str(verdict)


def in_flight_at(history: list[Op], moment: float) -> int:
    """Operations invoked before ``moment`` that ended after it (or never)."""
    started: dict[tuple[str, tuple[str, ...]], float] = {}
    ended_after = 0
    for op in history:
        key = (op.p, tuple(op.digests()))
        if op.type == "invoke":
            started[key] = op.t
        elif started.pop(key, op.t) < moment < op.t:
            ended_after += 1
    return ended_after + sum(1 for t in started.values() if t < moment)


def invoked_at(history: list[Op], completion: Op) -> float:
    """When the operation that ``completion`` ended was invoked."""
    return next(
        op.t
        for op in history
        if op.type == "invoke" and op.p == completion.p and op.digests() == completion.digests()
    )


async def across_a_takeover(c: LocalCluster) -> tuple[list[Op], set[int], str]:
    """30 appends through A (n0), A killed, 30 more acknowledged through B and C: the history,
    the ledgers the stream had under A, and the new owner."""
    a, b, cc = c.url("n0"), c.url("n1"), c.url("n2")
    async with StreamWorkload([a], STREAM, writers=2, batch_max=3, prefix="a") as first:
        first.start(operations=15)
        await first.join()
    assert first.acked == 30, first.outcomes
    by_a = {info["id"] for info in await stream_ledgers(c, STREAM)}
    await asyncio.to_thread(c.kill, "n0")
    async with StreamWorkload([b, cc], STREAM, writers=2, batch_max=3, prefix="b") as second:
        second.start()
        await second.wait_acked(30, TAKEOVER_TIMEOUT_S)
        await second.stop()
    new_owner = await owner(c, STREAM)
    assert new_owner in {"n1", "n2"}
    return merge(first.history(), second.history()), by_a, new_owner


async def until_true(condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        if await condition():
            return
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.2)


async def test_owner_killed_mid_append_loses_no_acknowledged_append(
    stream_cluster: LocalCluster,
) -> None:
    """Appends (single and batches, rolling ledgers every 4 entries) through A; A is
    SIGKILLed while some are in flight; the writers go on through B and C, which take the
    stream over; a cursor reading through C sees every acknowledged append exactly once, in
    order, positions strictly increasing across the takeover."""
    c = stream_cluster
    a, b, cc = c.url("n0"), c.url("n1"), c.url("n2")
    await create(c, "n0", STREAM, **KILL_ROLLOVER)
    async with StreamWorkload([a], STREAM, writers=4, batch_max=3, seed=1) as load:
        load.start()
        await load.wait_acked(60)
        assert await owner(c, STREAM) == "n0"
        before = load.acked
        killed_at = time.time()
        c.node("n0").signal(signal.SIGKILL)  # now: the writers' current appends are in flight
        load.urls[:] = [b, cc]  # before the loop runs again: no later append goes to A
        await asyncio.to_thread(c.kill, "n0")  # reaped
        await load.wait_acked(before + 60, timeout_s=TAKEOVER_TIMEOUT_S)
        await load.stop()
    history = load.history()
    assert in_flight_at(history, killed_at) >= 1  # the kill did hit appends in flight
    assert await owner(c, STREAM) in {"n1", "n2"}
    read = await read_back(cc, STREAM)
    verdict = clean(history, read)
    assert verdict.counts["acked_entries"] >= 120, verdict
    acked = [op for op in history if op.type == "ok"]
    before_kill = {op.ledger for op in acked if op.t < killed_at}
    after_kill = {op.ledger for op in acked if op.t > killed_at and op.ledger not in before_kill}
    assert after_kill and max(before_kill) < min(after_kill)  # type: ignore[type-var]
    ledgers = await stream_ledgers(c, STREAM)
    assert [info["id"] for info in ledgers] == sorted(info["id"] for info in ledgers)
    assert all(info["closed"] for info in ledgers[:-1]), ledgers  # only the last takes appends
    per_ledger = Counter(int(p.split(":")[0]) for p, _ in read)
    assert set(per_ledger) <= {info["id"] for info in ledgers}
    for info in ledgers[:-1]:  # a closed ledger's counts are final in its record
        assert info["entries"] == per_ledger[info["id"]], (info, per_ledger)
    await clean_replicas(c, history, read, STREAM)


async def test_paused_owner_acknowledges_nothing_after_its_lease(
    stream_cluster: LocalCluster,
) -> None:
    """A owns the stream and is SIGSTOPped while writers append through it: their appends in
    flight stop inside A, the next ones wait in its socket; B and C take the stream over once
    A's lease is gone (fencing A's ledger). A resumed: no append sent after the pause is
    acknowledged in a ledger A owned (fenced: unknown, or forwarded to the new owner), those in
    flight at the pause are acknowledged only if the recovery kept them, nothing acknowledged
    before is lost, and A, having lost its lease, forwards what it gets from then on."""
    c = stream_cluster
    a, b, cc = c.url("n0"), c.url("n1"), c.url("n2")
    await create(c, "n0", STREAM)
    async with (
        StreamWorkload([a], STREAM, writers=3, batch_max=2, prefix="w", timeout_s=120) as first,
        StreamWorkload([b, cc], STREAM, writers=2, batch_max=2, prefix="t") as others,
    ):
        first.start()
        await first.wait_acked(30)
        assert await owner(c, STREAM) == "n0"
        owned_by_a = {info["id"] for info in await stream_ledgers(c, STREAM)}
        paused_at = time.time()
        c.stop("n0")  # now: the writers' current appends stop inside A
        try:
            others.start()
            await wait_owner(c, STREAM, {"n1", "n2"}, TAKEOVER_TIMEOUT_S)
            await others.wait_acked(10, TAKEOVER_TIMEOUT_S)
        finally:
            c.cont("n0")
        await first.wait_acked(first.acked + 6, TAKEOVER_TIMEOUT_S)  # A serves (forwards) again
        await first.stop()
        await others.wait_acked(others.acked + 10, TAKEOVER_TIMEOUT_S)
        await others.stop()
    held = first.history()
    assert in_flight_at(held, paused_at) >= 1  # the pause did catch appends in A
    late = [
        op
        for op in held
        if op.type == "ok" and op.ledger in owned_by_a and invoked_at(held, op) > paused_at
    ]
    assert not late, late
    assert await owner(c, STREAM) in {"n1", "n2"}  # A did not take it back
    await asyncio.sleep(OWNER_TTL_S)  # A's keepalive has found its lease gone by now
    async with StreamWorkload([a], STREAM, writers=1, prefix="r") as resumed:
        resumed.start(operations=3)
        await resumed.join()
    assert resumed.acked == 3, resumed.outcomes  # forwarded to the new owner
    assert all(op.ledger not in owned_by_a for op in resumed.history() if op.type == "ok")
    history = merge(held, others.history(), resumed.history())
    read = await read_back(b, STREAM)
    clean(history, read)
    await clean_replicas(c, history, read, STREAM)


async def test_concurrent_takeovers_make_one_owner_and_one_ledger(
    stream_cluster: LocalCluster,
) -> None:
    """A owns several streams and is killed; once its lease is gone, appends reach B and C at
    the same moment for each stream. Per stream: one owner (B or C), exactly one new ledger
    after A's (closed), every append answered ok (the loser forwards to the winner), and the
    checker finds the stream clean."""
    c = stream_cluster
    a, b, cc = c.url("n0"), c.url("n1"), c.url("n2")
    names = [f"race{i}" for i in range(RACED_STREAMS)]
    firsts = []
    for name in names:
        await create(c, "n0", name)
        load = StreamWorkload([a], name, writers=1, prefix="a")
        async with load:
            load.start(operations=5)
            await load.join()
        assert load.acked == 5, load.outcomes
        firsts.append(load)
        assert await owner(c, name) == "n0"
    await asyncio.to_thread(c.kill, "n0")
    for name in names:
        await wait_owner(c, name, {None}, TAKEOVER_TIMEOUT_S)  # the lease ended
    before = {name: await stream_ledgers(c, name) for name in names}
    writers, operations = 4, 3
    races = [
        StreamWorkload([b, cc], name, writers=writers, prefix="r", seed=i)
        for i, name in enumerate(names)
    ]
    try:
        for race in races:
            race.start(operations=operations)  # every first append at once, half to B
        await asyncio.gather(*(race.join() for race in races))
    finally:
        for race in races:
            await race.close()
    for name, first, race in zip(names, firsts, races, strict=True):
        assert race.acked == writers * operations, (name, race.outcomes)
        assert await owner(c, name) in {"n1", "n2"}
        after = await stream_ledgers(c, name)
        old = [info["id"] for info in before[name]]
        assert [info["id"] for info in after[: len(old)]] == old, (before[name], after)
        assert len(after) == len(old) + 1, (name, before[name], after)
        assert all(info["closed"] for info in after[:-1]), after
        assert after[-1]["id"] > old[-1]
        assert {op.ledger for op in race.history() if op.type == "ok"} == {after[-1]["id"]}
        history = merge(first.history(), race.history())
        read = await read_back(cc, name)
        clean(history, read)
        await clean_replicas(c, history, read, name)


async def test_deleting_a_stream_leaves_nothing_anywhere(stream_cluster: LocalCluster) -> None:
    """A stream with several ledgers (rollover every 20 entries) and a cursor, deleted through a
    node that does not own it: every node answers 404 for it, and soon neither etcd
    (record, cursors, owner, doomed ledgers, ledger metadata) nor any node's ledger list holds
    anything of it."""
    c = stream_cluster
    urls = [c.url(n) for n in c.node_ids]
    await create(c, "n0", STREAM, **ROLLOVER)
    async with StreamWorkload(urls, STREAM, writers=2, batch_max=5) as load:
        load.start(operations=20)
        await load.join()
    assert load.acked == 40, load.outcomes
    status, body = await call(
        "PUT", f"{urls[3]}/api/v1/streams/{STREAM}/cursors/billing", {"start": "earliest"}
    )
    assert status == 201, body
    ledger_ids = {info["id"] for info in await stream_ledgers(c, STREAM)}
    assert len(ledger_ids) >= 3
    assert await etcd_keys(c, f"stream-cursors/{STREAM}/")
    held = set().union(*[await node_ledger_ids(url) for url in urls])
    assert ledger_ids <= held  # replicas exist before the deletion
    stream_owner = await owner(c, STREAM)
    via = next(n for n in c.node_ids if n != stream_owner)
    status, body = await call("DELETE", f"{c.url(via)}/api/v1/streams/{STREAM}")
    assert status == 204, body
    for url in urls:
        status, body = await call("GET", f"{url}/api/v1/streams/{STREAM}")
        assert status == 404 and body["code"] == "stream_not_found", (url, status, body)
    assert await stream_record(c, STREAM) is None

    async def nothing_left() -> bool:
        return not await leftovers(c, STREAM, ledger_ids)

    await until_true(nothing_left, "the deleted stream's replicas reclaimed", GONE_TIMEOUT_S)


async def test_retention_after_a_takeover_drops_the_old_owners_ledgers_everywhere(
    stream_cluster: LocalCluster,
) -> None:
    """Ledgers rolled by A, A killed, more rolled by the new owner; a cursor consumes it all.
    A retention run on the new owner deletes every closed ledger, A's included: they leave the
    stream's record, their metadata and every running node's replicas; the stream goes on."""
    c = stream_cluster
    b, cc = c.url("n1"), c.url("n2")
    await create(c, "n0", STREAM, retentionTimeInMinutes=0, **ROLLOVER)
    before, by_a, new_owner = await across_a_takeover(c)
    assert len(by_a) >= 2
    clean(before, await read_back(b, STREAM))
    ledgers = await stream_ledgers(c, STREAM)
    assert len(ledgers) > len(by_a) + 1  # the new owner rolled over too
    closed = {info["id"] for info in ledgers if info["closed"]}
    status, body = await call("POST", f"{c.url(new_owner)}/api/v1/retention/run")
    assert status == 200, body
    dropped = {entry["ledgerId"] for entry in body["streams"][STREAM]}
    assert by_a <= closed <= dropped, (by_a, closed, body)
    remaining = {info["id"] for info in await stream_ledgers(c, STREAM)}
    assert remaining and not remaining & dropped

    async def reclaimed() -> bool:
        return not await ledger_leftovers(c, dropped)

    await until_true(reclaimed, "the dropped ledgers' metadata and replicas gone", GONE_TIMEOUT_S)
    async with StreamWorkload([cc, b], STREAM, writers=1, prefix="c") as third:
        third.start(operations=3)
        await third.join()
    assert third.acked == 3, third.outcomes
    read = await read_back(cc, STREAM, cursor="after")
    assert {int(p.split(":")[0]) for p, _ in read} <= remaining | {
        op.ledger for op in third.history() if op.ledger is not None
    }
    # The rest holds what the history says of the ledgers that remain: the acknowledgments
    # into dropped ledgers are left out (retention deleted them; their invocations stay, as
    # appends of unknown outcome that are now absent).
    kept = [
        op for op in merge(before, third.history()) if op.type != "ok" or op.ledger not in dropped
    ]
    clean(kept, read)


async def test_retention_runs_racing_on_three_nodes_take_an_ownerless_stream_once(
    stream_cluster: LocalCluster,
) -> None:
    """A stream whose owner was SIGKILLed, and that no client asks for: no node owns it. Three
    retention runs at once, on the three other nodes (the DAG's mapped tasks): all succeed,
    one of them takes the stream over (one owner, one new ledger) and trims it; the others
    neither own nor trim it. Everything acknowledged in the ledgers left reads back."""
    c = stream_cluster
    await create(c, "n0", STREAM, retentionTimeInMinutes=0, **KILL_ROLLOVER)
    async with StreamWorkload([c.url("n0")], STREAM, writers=2, prefix="a") as load:
        load.start(operations=6)
        await load.join()
    assert load.acked == 12, load.outcomes
    before = await stream_ledgers(c, STREAM)
    await asyncio.to_thread(c.kill, "n0")
    await wait_owner(c, STREAM, {None})
    others = ["n1", "n2", "n3"]
    answers = await asyncio.gather(
        *(call("POST", f"{c.url(n)}/api/v1/retention/run") for n in others)
    )
    assert all(status == 200 for status, _ in answers), answers
    taker = await owner(c, STREAM)
    assert taker in others, taker
    trimmed = {n: body["streams"].get(STREAM) for n, (_, body) in zip(others, answers, strict=True)}
    assert all(trimmed[n] is None for n in others if n != taker), trimmed
    dropped = {entry["ledgerId"] for entry in trimmed[taker] or []}
    after = await stream_ledgers(c, STREAM)
    # One takeover: the ledgers before it (the last one closed by its recovery) and one new
    # ledger; the run trimmed the ones closed before the kill (and maybe the recovered one).
    had, has = {i["id"] for i in before}, {i["id"] for i in after}
    assert has - had == {after[-1]["id"]}, (before, after)
    assert not has & dropped and had == (has - {after[-1]["id"]}) | dropped, (before, after)
    assert {i["id"] for i in before[:-1]} <= dropped, (before, dropped)
    reader = c.url(next(n for n in others if n != taker))
    kept = [op for op in load.history() if op.type != "ok" or op.ledger not in dropped]
    clean(kept, await read_back(reader, STREAM))


TTL_S = 2  # messageTtlInSeconds of the TTL test: short, and longer than a retention run


async def test_message_ttl_after_a_takeover_moves_the_cursor_on_the_new_owner(
    stream_cluster: LocalCluster,
) -> None:
    """A stream with a message TTL and a cursor that reads nothing; ledgers rolled by A, A
    SIGKILLed, more rolled by the new owner. Once the TTL has passed for every closed ledger,
    a retention run on a node that does not own the stream moves nothing; one on the new
    owner moves the cursor to the end of the last closed ledger (the ledger taking appends
    never expires) and, the cursor being the slowest, trims every ledger before it (retention
    time 0). A new cursor at earliest reads nothing of a trimmed ledger and every
    acknowledged append of the rest once; the old cursor reads everything after its new
    mark once, appends made after the run included."""
    c = stream_cluster
    await create(c, "n0", STREAM, retentionTimeInMinutes=0, messageTtlInSeconds=TTL_S, **ROLLOVER)
    slow = f"{c.url('n3')}/api/v1/streams/{STREAM}/cursors/slow"
    status, body = await call("PUT", slow, {"start": "earliest"})
    assert status == 201, body
    before, by_a, new_owner = await across_a_takeover(c)
    assert len(by_a) >= 2
    ledgers = await stream_ledgers(c, STREAM)
    closed = [info for info in ledgers if info["closed"]]
    assert by_a <= {info["id"] for info in closed} and len(closed) < len(ledgers)
    await asyncio.sleep(
        max(0.0, max(i["closed"] for i in closed) / 1000 + TTL_S + 0.2 - time.time())
    )

    # A node that does not own the stream: its run neither moves the cursor nor trims.
    status, body = await call("POST", f"{c.url('n3')}/api/v1/retention/run")
    assert status == 200 and STREAM not in body["streams"], body
    status, cursor = await call("GET", slow)
    assert status == 200 and cursor["markDeletePosition"] == f"{ledgers[0]['id']}:-1", cursor
    status, body = await call("POST", f"{c.url(new_owner)}/api/v1/retention/run")
    assert status == 200, body
    # The run may first roll a full last ledger: that one closed just now, it has not expired.
    last_closed = closed[-1]
    after_it = ledgers[len(closed)]["id"]
    # Past every entry of the last closed ledger (written as the next ledger's -1 once the
    # trim dropped that one): without the TTL's move the cursor would have kept them all.
    stored = await etcd_get(c, f"stream-cursors/{STREAM}/slow")
    assert stored["markDelete"] in ([last_closed["id"], last_closed["entries"] - 1], [after_it, -1])
    dropped = {entry["ledgerId"] for entry in body["streams"][STREAM]}
    assert dropped == {info["id"] for info in closed}, (body, closed)
    remaining = await stream_ledgers(c, STREAM)
    assert not {info["id"] for info in remaining} & dropped
    # Shown as nothing acknowledged of the first ledger left.
    status, cursor = await call("GET", slow)
    assert status == 200 and cursor["markDeletePosition"] == f"{remaining[0]['id']}:-1", cursor
    backlog = cursor["backlogEntries"]

    async with StreamWorkload([c.url("n3")], STREAM, writers=1, prefix="c") as after:
        after.start(operations=3)
        await after.join()
    assert after.acked == 3, after.outcomes
    history = merge(before, after.history())
    # The acknowledgments into trimmed ledgers are left out (their invocations stay, as
    # appends of unknown outcome that are now absent).
    kept = [op for op in history if op.type != "ok" or op.ledger not in dropped]
    fresh = await read_back(c.url("n3"), STREAM, cursor="fresh")
    assert not {int(p.split(":")[0]) for p, _ in fresh} & dropped
    clean(kept, fresh)
    read = await read_back(c.url("n3"), STREAM, cursor="slow")  # from its new mark
    clean(kept, read)
    assert len(read) == backlog + after.acked and read == fresh  # nothing before the mark

    async def reclaimed() -> bool:
        return not await ledger_leftovers(c, dropped)

    await until_true(reclaimed, "the trimmed ledgers' metadata and replicas gone", GONE_TIMEOUT_S)


async def stored_objects(shared: Path) -> set[str]:
    """The offload objects in a local-directory store (audit snapshots aside)."""

    def listing() -> set[str]:
        return {
            str(path.relative_to(shared))
            for path in shared.rglob("*")
            if path.is_file() and path.suffix in (".data", ".index")
        }

    return await asyncio.to_thread(listing)


async def test_offload_across_takeovers_drops_replicas_reads_on_and_deletes_objects(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    """Every node shares one object store (a local directory, as one S3 bucket would be).
    Ledgers rolled by A, A killed, more rolled by the new owner B; an offload run on B sends
    every closed ledger, A's included, to the store and, with no deletion lag, deletes their
    replicated ledgers: their replicas leave every node, the record says so, the ledger taking
    appends keeps its replicas. No node calls those objects unknown (they are another node's
    stream's). A cursor through a third node reads every acknowledged append from the store.
    Then B stops and another node takes the stream over (the offloaded ledgers have no
    replica left to recover): appends go on, and everything still reads back. Deleting the
    stream deletes its objects too."""
    shared = tmp_path / "objects"
    env = {**STREAM_CLUSTER_ENV, "NODE_OFFLOAD_LOCAL_DIR": str(shared)}
    c = await asyncio.to_thread(make_cluster, nodes=NODES, env=env)
    await create(c, "n0", STREAM, **ROLLOVER, **OFFLOAD_NOW)
    history, by_a, new_owner = await across_a_takeover(c)
    ledgers = await stream_ledgers(c, STREAM)
    closed = {info["id"] for info in ledgers if info["closed"]}
    last = ledgers[-1]["id"]
    assert len(closed) >= 3 and by_a <= closed and last not in closed

    status, body = await call("POST", f"{c.url(new_owner)}/api/v1/offload/run", {})
    assert status == 200, body
    assert set(body["offloaded"]) == closed and set(body["localDeleted"]) == closed, body
    record = {info["id"]: info for info in await stream_ledgers(c, STREAM)}
    for lid in closed:
        offload = record[lid]["offload"]
        assert offload["state"] == "offloaded" and offload["replicasDeleted"], record[lid]
    assert "offload" not in record[last]
    objects = await stored_objects(shared)
    assert {int(key.split("/")[0]) for key in objects} == closed, objects

    async def replicas_gone() -> bool:
        return not await ledger_leftovers(c, closed)

    await until_true(replicas_gone, "the offloaded ledgers' replicas reclaimed", GONE_TIMEOUT_S)
    assert last in set().union(*[await node_ledger_ids(c.url(n)) for n in ("n1", "n2", "n3")])
    others = [n for n in c.node_ids if n not in ("n0", new_owner)]
    for node_id in others:
        status, body = await call("GET", f"{c.url(node_id)}/api/v1/offload/status")
        assert status == 200 and body["unknownObjects"] == [], (node_id, body)
    reader = c.url(others[0])
    clean(history, await read_back(reader, STREAM))

    # The next owner: the one before stops cleanly (its lease revoked), n0 comes back so that
    # four nodes can form a new ensemble of three, and the next request takes the stream over.
    await asyncio.to_thread(c.terminate, new_owner)
    await asyncio.to_thread(c.start, "n0")
    async with StreamWorkload([reader], STREAM, writers=1, prefix="c") as third:
        third.start(operations=5)
        await third.join()
    assert third.acked == 5, third.outcomes
    assert await owner(c, STREAM) == others[0]
    clean(merge(history, third.history()), await read_back(c.url("n0"), STREAM, cursor="again"))

    status, body = await call("DELETE", f"{reader}/api/v1/streams/{STREAM}")
    assert status == 204, body
    assert await stored_objects(shared) == set()
    every = {info["id"] for info in ledgers} | {
        op.ledger for op in third.history() if op.ledger is not None
    }

    async def nothing_left() -> bool:
        return not await leftovers(c, STREAM, every)

    await until_true(nothing_left, "the deleted stream's keys and replicas gone", GONE_TIMEOUT_S)


async def test_offload_races_reads_and_deletions(make_cluster: MakeCluster, tmp_path: Path) -> None:
    """Offload runs (no deletion lag: replicas dropped within the run) fired together with
    what touches the same ledgers: a cursor reading the stream through another node (a read
    may begin on the replicas and find them gone), and the stream's deletion (an upload in
    flight whose ledger goes). Reads stay clean; each deleted stream leaves no object, no key
    and no replica behind, whichever finished first."""
    shared = tmp_path / "objects"
    env = {**STREAM_CLUSTER_ENV, "NODE_OFFLOAD_LOCAL_DIR": str(shared)}
    c = await asyncio.to_thread(make_cluster, nodes=NODES, env=env)
    owner_url, reader = c.url("n0"), c.url("n1")
    delays_s = [0.0, 0.01, 0.03, 0.06]  # the deletion fired this long after the run
    names = [f"race-{n}" for n in range(len(delays_s))]
    histories = {}
    for name in names:
        await create(c, "n0", name, **ROLLOVER, **OFFLOAD_NOW)
        async with StreamWorkload([owner_url], name, writers=2, batch_max=3) as load:
            load.start(operations=20)
            await load.join()
        assert load.acked == 40, load.outcomes
        histories[name] = load.history()

    run = call("POST", f"{owner_url}/api/v1/offload/run", {"stream": names[0]})
    (status, body), read = await asyncio.gather(run, read_back(reader, names[0]))
    assert status == 200 and body["offloaded"] and not body["failed"], body
    clean(histories[names[0]], read)
    clean(histories[names[0]], await read_back(reader, names[0], cursor="after"))

    every: set[int] = set()
    for n, name in enumerate(names):
        every |= {info["id"] for info in await stream_ledgers(c, name)}

        async def delete_later(name: str = name, delay_s: float = delays_s[n]) -> tuple[int, Any]:
            await asyncio.sleep(delay_s)
            return await call("DELETE", f"{reader}/api/v1/streams/{name}")

        run = call("POST", f"{owner_url}/api/v1/offload/run", {"stream": name})
        (status, body), (deleted, why) = await asyncio.gather(run, delete_later())
        assert deleted == 204, why
        # The run either finished first, or found the stream gone (404) or its ledgers gone.
        assert status in (200, 404) and not (status == 200 and body["failed"]), body

    async def nothing_left() -> bool:
        left = [key for name in names for key in await leftovers(c, name, every)]
        return not left and not await stored_objects(shared)

    await until_true(nothing_left, "the deleted streams' objects, keys and replicas gone", 60)


async def test_a_takeover_settles_every_ledger_whose_close_was_not_confirmed(
    stream_cluster: LocalCluster,
) -> None:
    """An owner whose rollover's close failed (etcd away for a moment), then rolled over
    again and died, leaves a record whose third-to-last ledger is still OPEN in etcd and
    holds more acknowledged entries than the record counts (``closing``). The next owner
    fences and recovers it too, so that a reader sees every entry in it."""
    c = stream_cluster
    name = "unsealed"
    status, body = await put_stream(c.url("n0"), name, {"replication": REPLICATED})
    assert status == 201, body
    client = Client(c.metadata_url)
    try:
        props = {"stream": name}
        first = await client.create_ledger(3, 3, 2, props)
        for n in range(5):
            await first.add(f"first {n}".encode())  # acknowledged; the record counts two
        second = await client.create_ledger(3, 3, 2, props)
        for n in range(2):
            await second.add(f"second {n}".encode())
        await second.close()
        last = await client.create_ledger(3, 3, 2, props)
        await last.add(b"last 0")
        await asyncio.to_thread(c.terminate, "n0")  # its lease revoked; it writes nothing more
        record = await stream_record(c, name)
        now = int(time.time() * 1000)
        record["ledgers"] = [
            {"id": first.id, "entries": 2, "bytes": 14, "created": now, "closed": now,
             "closing": True},
            {"id": second.id, "entries": 2, "bytes": 16, "created": now, "closed": now},
            {"id": last.id, "entries": 0, "bytes": 0, "created": now, "closed": 0},
        ]  # fmt: skip
        key = f"streams/{name}"
        found = await client.store.get(key)
        assert found is not None
        await client.store.cas(key, json.dumps(record).encode(), found.revision)
    finally:
        await client.close()
    read = await read_back(c.url("n1"), name)  # n1 takes the stream over
    assert [payload for _position, payload in read] == [
        *(f"first {n}".encode() for n in range(5)),
        b"second 0",
        b"second 1",
        b"last 0",
    ]
    settled = await stream_ledgers(c, name)
    assert settled[0]["entries"] == 5 and "closing" not in settled[0], settled
