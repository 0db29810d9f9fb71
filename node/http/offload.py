"""Offload routes: runs (with a dry run), status, removal of unknown objects."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from node.http.errors import ApiError
from node.http.state import WORK

routes = web.RouteTableDef()


async def _run_body(request: web.Request) -> tuple[str | None, list[int] | None]:
    raw = await request.read()
    if not raw.strip():
        return None, None
    try:
        body: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, "invalid_json", f"body is not JSON: {e}") from None
    if not isinstance(body, dict) or set(body) - {"stream", "ledgers"}:
        raise ApiError(400, "invalid_body", 'body must be {"stream": "name", "ledgers": [ids]}')
    stream = body.get("stream")
    if "stream" in body and not isinstance(stream, str):
        raise ApiError(400, "invalid_body", "stream must be a stream name")
    ledgers = body.get("ledgers")
    if "ledgers" in body and (
        not isinstance(ledgers, list)
        or not all(type(i) is int and 0 <= i < 1 << 63 for i in ledgers)
    ):
        raise ApiError(400, "invalid_body", "ledgers must be a list of ledger ids")
    return stream, ledgers


@routes.post("/api/v1/offload/run")
async def run_offload(request: web.Request) -> web.Response:
    dry_run = request.query.get("dryRun", "false").lower()
    if dry_run not in ("true", "false"):
        raise ApiError(400, "invalid_query", "dryRun is true or false")
    stream, ledgers = await _run_body(request)
    result = await request.app[WORK].offload.run(dry_run == "true", stream, ledgers)
    return web.json_response(result.to_json(dry_run == "true"))


@routes.get("/api/v1/offload/status")
async def offload_status(request: web.Request) -> web.Response:
    return web.json_response(await request.app[WORK].offload.status())


@routes.delete("/api/v1/offload/unknown-objects")
async def remove_unknown_objects(request: web.Request) -> web.Response:
    removed = await request.app[WORK].offload.remove_unknown_objects()
    return web.json_response({"removed": removed})
