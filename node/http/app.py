"""The aiohttp application and the ``serve`` loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator

from aiohttp import web

from node.http import ledgers
from node.http.errors import error_middleware
from node.http.state import SETTINGS, STORAGE
from node.settings import Settings
from node.storage.ledgers import LedgerStorage

log = logging.getLogger(__name__)


def build_app(settings: Settings, storage: LedgerStorage | None = None) -> web.Application:
    """The application; it starts and closes its own storage unless one is given."""
    app = web.Application(client_max_size=settings.max_request_size, middlewares=[error_middleware])
    app[SETTINGS] = settings
    app[STORAGE] = storage or LedgerStorage(settings)
    if storage is None:
        app.cleanup_ctx.append(_storage_lifecycle)
    app.add_routes(ledgers.routes)
    return app


async def _storage_lifecycle(app: web.Application) -> AsyncIterator[None]:
    await app[STORAGE].start()
    yield
    await app[STORAGE].close()


async def serve(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT, then stop accepting, finish requests, checkpoint."""
    app = build_app(settings)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.http_host, settings.http_port, reuse_address=True)
    await site.start()
    log.info(
        "listening on http://%s:%s, data in %s",
        settings.http_host,
        settings.http_port,
        settings.data_dir,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: finishing requests, then a final checkpoint")
    await runner.cleanup()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(Exception):
            loop.remove_signal_handler(sig)
    log.info("stopped cleanly")
