"""Typed application state shared by the route modules."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from node.http.budget import BodyBudget
from node.http.models import AuditResult
from node.lifecycle import BackgroundWork
from node.metrics import Metrics
from node.settings import Settings
from node.storage.ledgers import LedgerStorage
from node.streams.manager import StreamManager


@dataclass(slots=True)
class ServingState:
    """The HTTP server's start and stop flags, as the readiness probe and /state report them
    (the background work of node/lifecycle is another matter)."""

    started: bool = False
    shutting_down: bool = False


@dataclass(slots=True)
class AuditState:
    """The last audit summary posted (POST /api/v1/audit/result), None before the first."""

    last: AuditResult | None = None
    snapshot_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one snapshot at a time


STORAGE = web.AppKey("storage", LedgerStorage)
SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", Metrics)
SERVING = web.AppKey("serving", ServingState)
WORK = web.AppKey("work", BackgroundWork)
STREAMS = web.AppKey("streams", StreamManager)
BUDGET = web.AppKey("budget", BodyBudget)
READ_BUDGET = web.AppKey("read_budget", BodyBudget)  # read replies (node/http/replies.py)
AUDIT = web.AppKey("audit", AuditState)
