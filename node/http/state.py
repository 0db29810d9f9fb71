"""Typed application state shared by the route modules."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from node.http.budget import BodyBudget
from node.http.models import AuditResult
from node.http.throttle import ByteRate
from node.lifecycle import BackgroundWork
from node.lifecycle.metrics import StateMetrics
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
    # Paces the snapshot files served to the audit's executors (audit_serve_bytes_per_s).
    serve_rate: ByteRate = field(default_factory=lambda: ByteRate(0))


STORAGE = web.AppKey("storage", LedgerStorage)
SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", Metrics)
STATE_METRICS = web.AppKey("state_metrics", StateMetrics)  # the scrape's snapshot
SERVING = web.AppKey("serving", ServingState)
WORK = web.AppKey("work", BackgroundWork)
STREAMS = web.AppKey("streams", StreamManager)
BUDGET = web.AppKey("budget", BodyBudget)
READ_BUDGET = web.AppKey("read_budget", BodyBudget)  # read replies (node/http/replies.py)
AUDIT = web.AppKey("audit", AuditState)


class ReplicaGuard(Protocol):
    """Whether a replicated ledger may be reclaimed here: only once the metadata store says
    it is gone (a linearizable read). Raises ``node.client.errors.MetadataError`` when the
    store does not answer (then nothing is deleted)."""

    async def confirm_deleted(self, ledger_id: int) -> bool: ...


class LedgerSource(Protocol):
    """The metadata store, as an audit snapshot reads it (``node.audit.fleet.dump``)."""

    async def range(self, prefix: str) -> list[tuple[str, Any]]: ...


# The node's metadata store when it has one (metadata_url): each audit snapshot carries the
# replicated ledgers' metadata, read from it just before, for the replicas check.
AUDIT_LEDGER_SOURCE: web.AppKey[LedgerSource] = web.AppKey("audit_ledger_source")

# Installed when the node has a metadata store (metadata_url); absent or None: a replicated
# ledger is never deleted through the HTTP API.
REPLICA_GUARD: web.AppKey[ReplicaGuard | None] = web.AppKey("replica_guard")
