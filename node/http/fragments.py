"""The replica's half of the ledger check (node/autorecovery/ledgercheck.py): which ids of a
fragment this node lacks, from its index and write caches, no payload read.

``GET /api/v1/ledgers/{lid}/missing?from=A&to=B`` asks about every id of [A, B]; with
``ensembleSize``, ``writeQuorumSize`` and ``position`` (all three) only about the ids whose
write set holds the node at that position of the segment's ensemble (node/client/stripes.py).
The answer names the missing ranges, ``limit`` of them at most: a reply cut there says
``nextFrom``, where the asker goes on. An unknown ledger is 404 ledger_not_found (the asker
counts all of it missing), a local one 409 not_replicated."""

from __future__ import annotations

from aiohttp import web

from node.client import protocol
from node.client.stripes import Stripe, shortfall
from node.http import models
from node.http.errors import ApiError
from node.http.jsonreply import json_response
from node.http.ledgers import parse_id
from node.http.state import STORAGE

routes = web.RouteTableDef()

# Missing ranges in one reply: a few hundred KiB of JSON at most, whatever the fragment.
DEFAULT_MISSING_RANGES = 1000
MAX_MISSING_RANGES = 10_000
# The largest ensemble a replicated ledger records (u16 in the index's ledger record).
MAX_ENSEMBLE = 0xFFFF
STRIPE_PARAMETERS = ("ensembleSize", "writeQuorumSize", "position")
INVALID_STRIPE = "invalid_stripe"


def _stripe(request: web.Request) -> Stripe | None:
    given = [request.query.get(name) for name in STRIPE_PARAMETERS]
    if all(value is None for value in given):
        return None
    if any(value is None for value in given):
        raise ApiError(
            422, INVALID_STRIPE, f"{', '.join(STRIPE_PARAMETERS)} come together, or not at all"
        )
    ensemble, quorum, position = (
        parse_id(value, name) for value, name in zip(given, STRIPE_PARAMETERS, strict=True)
    )
    if ensemble > MAX_ENSEMBLE:
        raise ApiError(400, INVALID_STRIPE, f"ensembleSize is at most {MAX_ENSEMBLE}")
    try:
        return Stripe(ensemble, quorum, position)
    except ValueError as error:
        raise ApiError(422, INVALID_STRIPE, str(error)) from None


@routes.get("/api/v1/ledgers/{lid}/missing")
async def missing(request: web.Request) -> web.Response:
    ledger_id = parse_id(request.match_info["lid"], "ledger id")
    first = parse_id(request.query.get("from"), "from", default=0)
    last = parse_id(request.query.get("to"), "to")
    limit = parse_id(request.query.get("limit"), "limit", default=DEFAULT_MISSING_RANGES)
    if not 1 <= limit <= MAX_MISSING_RANGES:
        raise ApiError(400, "invalid_limit", f"limit is in [1, {MAX_MISSING_RANGES}]")
    if first > last:
        raise ApiError(422, "invalid_range", f"from ({first}) is after to ({last})")
    stripe = _stripe(request) or Stripe(1, 1, 0)
    storage = request.app[STORAGE]
    if storage.ledger(ledger_id).replication is None:
        raise ApiError(
            409, protocol.NOT_REPLICATED, f"ledger {ledger_id} is a local ledger of this node"
        )
    held = await storage.held_runs(ledger_id, first, last)
    found = shortfall(stripe, held, first, last, limit)
    return json_response(
        models.ReplicaMissing(
            ledgerId=ledger_id,
            checkedTo=found.covered,
            missing=[[low, high] for low, high in found.missing],
            missingEntries=found.missing_entries,
            heldEntries=found.held,
            nextFrom=found.covered + 1 if found.covered < last else None,
        ).to_json()
    )
