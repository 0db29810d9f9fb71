"""Offload routes: runs (with a dry run), status, removal of unknown objects."""

from __future__ import annotations

from aiohttp import web

from node.http import models
from node.http.errors import ApiError
from node.http.forward import FORWARDER
from node.http.jsonreply import json_response
from node.http.state import WORK
from node.http.streams import STREAM_ROUTER, not_twice, owner_url

routes = web.RouteTableDef()


@routes.post("/api/v1/offload/run")
async def run_offload(request: web.Request) -> web.StreamResponse:
    dry_run = request.query.get("dryRun", "false").lower()
    if dry_run not in ("true", "false"):
        raise ApiError(400, "invalid_query", "dryRun is true or false")
    body = models.OFFLOAD_RUN.parse(await request.read())
    stream, ledgers = body.get("stream"), body.get("ledgers")
    if stream is not None:
        # A replicated stream is offloaded by its owner only (its offload records are
        # guarded by the ownership): a run naming one that another node owns goes there.
        url = await owner_url(request.app, stream)
        if url is not None:
            await not_twice(request, stream, url)
            request.app[STREAM_ROUTER].forwarded += 1
            return await request.app[FORWARDER].forward(request, url)
    result = await request.app[WORK].offload.run(dry_run == "true", stream, ledgers)
    return json_response(result.to_json(dry_run == "true"))


@routes.get("/api/v1/offload/status")
async def offload_status(request: web.Request) -> web.Response:
    return json_response(await request.app[WORK].offload.status())


@routes.delete("/api/v1/offload/unknown-objects")
async def remove_unknown_objects(request: web.Request) -> web.Response:
    return json_response(await request.app[WORK].offload.remove_unknown_objects())
