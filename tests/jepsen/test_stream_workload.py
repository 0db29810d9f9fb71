"""The stream workload's outcomes against a scripted HTTP server: what each answer (or the lack
of one) is logged as, the positions of ok appends and batches, round-robin over the URLs, and
payloads unique per writer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from node.jepsen.history import digest
from node.jepsen.streams import StreamWorkload
from node.localcluster import free_port
from node.wire import decode_batch

Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]
HANG_S = 5.0  # longer than the workload's timeout in these tests


def error(status: int, code: str) -> Answer:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response({"code": code, "message": "scripted"}, status=status)

    return answer


def position(text: str) -> Answer:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response({"position": text}, status=201)

    return answer


async def batch_reply(request: web.Request) -> web.StreamResponse:
    entries = len(await decode_batch(await request.read(), 100))
    return web.json_response(
        {"firstPosition": "7:3", "lastPosition": f"7:{3 + entries - 1}"}, status=201
    )


async def not_json(request: web.Request) -> web.StreamResponse:
    return web.Response(status=502, text="bad gateway")


async def hang(request: web.Request) -> web.StreamResponse:
    await asyncio.sleep(HANG_S)
    return web.json_response({"position": "9:9"}, status=201)


async def cut(request: web.Request) -> web.StreamResponse:
    assert request.transport is not None
    request.transport.close()  # the request arrived; its answer never leaves
    await asyncio.sleep(HANG_S)
    raise AssertionError("unreachable")


async def scripted(aiohttp_server: Any, answers: list[Answer], seen: list[str]) -> str:
    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(request.match_info["name"])
        return await answers.pop(0)(request)

    app = web.Application()
    app.router.add_post("/api/v1/streams/{name}/entries", handler)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def test_each_answer_is_ok_fail_or_unknown(aiohttp_server: Any) -> None:
    seen: list[str] = []
    answers = [
        position("5:0"),
        error(409, "ledger_closed"),  # every 4xx: nothing written
        error(400, "invalid_policy"),
        error(503, "not_owner"),  # refused before it was handled
        error(503, "owner_unreachable"),  # forwarded: no connection to the owner was made
        error(503, "overloaded"),
        error(503, "append_outcome_unknown"),  # a fenced owner: unknown
        error(503, "metadata_unavailable"),  # no code that proves nothing was written
        error(500, "io_error"),
        not_json,
        hang,
        cut,
    ]
    url = await scripted(aiohttp_server, answers, seen)
    expected = ["ok", "fail", "fail", "fail", "fail", "fail", "info", "info", "info", "info"]
    expected += ["info", "info"]
    async with StreamWorkload([url], "s", writers=1, timeout_s=1.0) as load:
        ops = [await load.append(0) for _ in expected]
    assert [op.type for op in ops] == expected, load.outcomes
    assert (ops[0].ledger, ops[0].entry) == (5, 0)
    assert all(op.ledger is None for op in ops[1:])
    assert seen == ["s"] * len(expected)
    assert load.acked == 1
    assert load.outcomes["503 append_outcome_unknown"] == 1 and load.outcomes["502 "] == 1
    history = load.history()
    assert [op.type for op in history[::2]] == ["invoke"] * len(expected)
    assert history[1].digest == digest(b"w0-1") and history[-1].digest == digest(b"w0-12")


async def test_a_refused_connection_is_a_failure(aiohttp_server: Any) -> None:
    """Nothing listens there: no byte of the request was sent."""
    async with StreamWorkload([f"http://127.0.0.1:{free_port()}"], "s", writers=1) as load:
        op = await load.append(0)
    assert op.type == "fail" and load.outcomes == {"refused": 1}


async def test_batches_and_round_robin_over_the_nodes(aiohttp_server: Any) -> None:
    first: list[str] = []
    second: list[str] = []
    one = await scripted(aiohttp_server, [batch_reply, batch_reply], first)
    two = await scripted(aiohttp_server, [position("8:0"), position("8:1")], second)
    async with StreamWorkload([one, two], "s", writers=2, prefix="b") as load:
        ops = [
            await load.append(0, entries=3),
            await load.append(1),
            await load.append(1, entries=2),
            await load.append(0),
        ]
    assert [(op.f, op.type, op.ledger, op.entry) for op in ops] == [
        ("append_batch", "ok", 7, 3),
        ("append", "ok", 8, 0),
        ("append_batch", "ok", 7, 3),
        ("append", "ok", 8, 1),
    ]
    assert len(first) == len(second) == 2
    assert ops[0].digests() == [digest(f"b0-{i}".encode()) for i in (1, 2, 3)]
    assert ops[2].digests() == [digest(b"b1-2"), digest(b"b1-3")]
    assert ops[3].digest == digest(b"b0-4")
    assert json.loads(json.dumps(load.outcomes)) == {"201": 4}


async def test_writers_run_their_operations_one_after_the_other(aiohttp_server: Any) -> None:
    seen: list[str] = []
    answers = [position(f"1:{i}") for i in range(6)]
    url = await scripted(aiohttp_server, answers, seen)
    async with StreamWorkload([url], "s", writers=3) as load:
        load.start(operations=2)
        await load.wait_acked(6, timeout_s=10)
        await load.join()
    for process in ("w0", "w1", "w2"):
        types = [op.type for op in load.history() if op.p == process]
        assert types == ["invoke", "ok", "invoke", "ok"]
