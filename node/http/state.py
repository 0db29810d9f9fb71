"""Typed application state shared by the route modules."""

from __future__ import annotations

from aiohttp import web

from node.settings import Settings
from node.storage.ledgers import LedgerStorage

STORAGE = web.AppKey("storage", LedgerStorage)
SETTINGS = web.AppKey("settings", Settings)
