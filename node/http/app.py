"""The aiohttp application and the ``serve`` loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from node import runtime
from node.http import (
    admin,
    audit,
    autorecovery,
    crosssite,
    forward,
    fragments,
    ledgers,
    offload,
    openapi,
    status,
    streams,
)
from node.http.bodies import bounded_body
from node.http.budget import BodyBudget
from node.http.connections import ConnectionLimit, HangupCancels
from node.http.errors import HTTP_CODES, error_body, error_middleware
from node.http.fastlane import FastLane, Lanes
from node.http.middleware import install_node_id, request_context, require_admin_token
from node.http.state import (
    AUDIT,
    AUDIT_LEDGER_SOURCE,
    BUDGET,
    METRICS,
    READ_BUDGET,
    REPLICA_GUARD,
    SERVING,
    SETTINGS,
    STATE_METRICS,
    STORAGE,
    STREAMS,
    WORK,
    AuditState,
    ServingState,
)
from node.http.throttle import ByteRate
from node.lifecycle import BackgroundWork
from node.lifecycle.metrics import StateMetrics
from node.metrics import Metrics
from node.replication.cookie import instance_id_bytes
from node.settings import Settings
from node.storage.clock import Clock, SystemClock
from node.storage.ledgers import LedgerStorage
from node.streams.manager import StreamManager
from node.wire import JSON_CONTENT_TYPE

if TYPE_CHECKING:
    from node.replication.cookie import Cookie
    from node.replication.service import Replication

log = logging.getLogger(__name__)

MAX_HEADER_FIELD_SIZE = 16 * 1024  # longer header lines are refused (431/400, as JSON)
REPLICATION: web.AppKey[Replication] = web.AppKey("replication")


def build_app(
    settings: Settings,
    storage: LedgerStorage | None = None,
    clock: Clock | None = None,
    cookie: Cookie | None = None,
) -> web.Application:
    """The application; it starts and closes its own storage unless one is given. Its
    parts all read and wait for time on ``clock`` (the system's unless one is given; a
    given storage keeps the clock it was built with). With a metadata store, ``cookie`` is
    the one ``python -m node serve`` checked; without, the application checks it before
    its storage starts."""
    clock = clock or SystemClock()
    app = web.Application(
        client_max_size=settings.max_request_size,
        # Bodies are read after authentication: an unauthorized one is never buffered.
        middlewares=[
            request_context,
            error_middleware,
            crosssite.refuse_cross_site,
            require_admin_token,
            bounded_body,
        ],
        handler_args={
            "max_field_size": MAX_HEADER_FIELD_SIZE,
            "keepalive_timeout": settings.keepalive_timeout_s,
            # A refused body (413, 503) is read and dropped this long, so that its client
            # sees the answer instead of a reset; then the connection closes.
            "lingering_time": settings.body_read_timeout_s,
        },
    )
    metrics = Metrics(settings)
    app[STATE_METRICS] = StateMetrics(metrics)
    app[SETTINGS] = settings
    app[BUDGET] = BodyBudget(settings.max_request_bytes_in_flight)
    app[READ_BUDGET] = read_budget = BodyBudget(settings.max_read_bytes_in_flight)
    metrics.read_reply_bytes.set_function(lambda: read_budget.in_use)  # read at each scrape
    app[METRICS] = metrics
    app[SERVING] = ServingState()
    app[STORAGE] = storage or LedgerStorage(
        settings,
        clock=clock,
        probe=metrics,
        instance_id=functools.partial(instance_id_bytes, settings.data_dir),
    )
    app[STREAMS] = StreamManager(app[STORAGE], clock)
    app[AUDIT] = AuditState(serve_rate=ByteRate(settings.audit_serve_bytes_per_s))
    if settings.metadata_url:
        # Imported only here: a node without a metadata store never loads node.client.
        from node.client.bookies import Transport
        from node.client.registry import Registry
        from node.replication.local import LocalReplica
        from node.replication.service import Replication
        from node.streams.router import replicated_streams

        app[REPLICATION] = replication = Replication(
            settings, app[STORAGE], metrics, clock, cookie=cookie
        )
        token = settings.admin_token.get_secret_value() if settings.admin_token else None
        storage_ = app[STORAGE]

        def local(remote: Transport) -> Transport:
            """Adds to and reads of this node's own replica skip HTTP (node.replication.local)."""
            return LocalReplica(
                remote, settings.id, storage_, metrics, settings.max_read_reply_bytes
            )

        app[STREAMS], router = replicated_streams(settings, replication.store, clock, token, local)
        app[streams.STREAM_ROUTER] = router
        app[streams.NODE_REGISTRY] = Registry(replication.store)
        if metrics.streams_owned is not None and metrics.stream_takeovers is not None:
            manager = app[STREAMS]
            metrics.streams_owned.set_function(lambda: len(manager.streams()))
            router.on_takeover = metrics.stream_takeovers.inc
        app[status.REPLICATION_SUMMARY] = lambda: {**replication.summary(), **router.summary()}
        app[status.FLEET_VIEW] = replication.fleet.view_summary
        app[REPLICA_GUARD] = replication.guard
        autorecovery.install(app, replication)
        app[AUDIT_LEDGER_SOURCE] = replication.store
        app.cleanup_ctx.append(_replication_identity)
    app[WORK] = BackgroundWork(app[STORAGE], app[STREAMS], clock, app.get(streams.STREAM_ROUTER))
    app.cleanup_ctx.append(_storage_lifecycle if storage is None else _given_storage)
    if settings.metadata_url:
        app.cleanup_ctx.append(_replication_lifecycle)
        forward.install(app)  # requests about streams another node owns go there
        app.cleanup_ctx.append(_stream_ownership)
    app.on_shutdown.append(_begin_shutdown)
    app.add_routes(ledgers.routes)
    app.add_routes(admin.routes)
    app.add_routes(streams.routes)
    app.add_routes(offload.routes)
    app.add_routes(audit.routes)
    app.add_routes(autorecovery.routes)
    app.add_routes(fragments.routes)
    app.add_routes(openapi.routes)
    status.install(app, clock)
    crosssite.install(app)
    install_node_id(app)
    return app


async def _storage_lifecycle(app: web.Application) -> AsyncIterator[None]:
    await app[WORK].before_storage_start()
    await app[STORAGE].start()
    await app[STREAMS].start()
    await audit.restore(app)
    await app[WORK].start()
    app[SERVING].started = True
    yield
    await app[WORK].stop()
    await app[STORAGE].close()


async def _replication_identity(app: web.Application) -> AsyncIterator[None]:
    """Before the storage starts: the cookie (the journal writes its instance id). `python
    -m node serve` checked it already and refuses to start without; an application built
    in-process whose store does not answer runs without one: it deletes no replica (the
    guard cannot confirm) and registers nowhere."""
    replication = app[REPLICATION]
    try:
        await replication.check_cookie(required=False)
        yield
    finally:
        await replication.stop()


async def _replication_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """After the storage started: the replica guard and its GC sweep."""
    await app[REPLICATION].start()
    yield
    sweep = app[REPLICATION].sweep
    if sweep is not None:
        await sweep.stop()


async def _stream_ownership(app: web.Application) -> AsyncIterator[None]:
    """The lease this node owns replicated streams under; revoked when it stops, so that
    the next request to any node takes its streams over at once."""
    router = app[streams.STREAM_ROUTER]
    await router.start()
    yield
    await router.stop()


async def _given_storage(app: web.Application) -> AsyncIterator[None]:
    await app[STREAMS].start()
    await audit.restore(app)
    app[SERVING].started = True
    yield


async def _begin_shutdown(app: web.Application) -> None:
    """Before in-flight requests are awaited: readiness fails and long polls return now
    instead of holding the shutdown for their whole timeout."""
    app[SERVING].shutting_down = True
    app[STORAGE].release_waiters()


class _JsonErrorRequestHandler(RequestHandler, HangupCancels):
    """Errors found before a request reaches the application (a malformed request line,
    headers too large) get the same JSON error body as every other error; a request head
    that is not complete ``header_timeout`` seconds after its first byte closes the
    connection (slowloris: a head trickled a byte at a time would otherwise hold it until
    the keep-alive timeout, and bytes keep coming); a long poll ends with its connection."""

    def __init__(self, manager: web.Server, *, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None

    def _between_requests(self) -> bool:
        # aiohttp's own state: no request is being handled and none is parsed and queued,
        # so bytes arriving now are the head of the next one.
        return not self._request_in_progress and not self._messages

    def data_received(self, data: bytes) -> None:
        if data and self._head_timer is None and self._between_requests():
            self._head_timer = self._loop.call_later(self._header_timeout, self._head_late)
        super().data_received(data)
        if self._messages:
            self._cancel_head_timer()

    async def _handle_request(self, *args: Any, **kwargs: Any) -> Any:
        # A body's bytes can arrive between the parse of its head and this call and start
        # the timer as if they began a head: the head is complete, so stop it.
        self._cancel_head_timer()
        return await super()._handle_request(*args, **kwargs)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        # Still waiting for a head (as aiohttp's keep-alive check asks): not handling a
        # request, nor draining a refused body (bytes that also started the timer).
        if self._waiter is not None and not self._waiter.done():
            log.info("closed a connection: no complete request head in %s s", self._header_timeout)
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_timer()
        self.hung_up()
        super().connection_lost(exc)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            self.log_exception("Error handling request", exc_info=exc)
        else:
            log.info("refused a malformed request (%d): %s", status, exc or message)
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        code = HTTP_CODES.get(status, f"http_{status}")
        text = message or (exc and str(exc)) or HTTPStatus(status).phrase
        response = web.Response(
            status=status, body=error_body(code, str(text)[:500]), content_type=JSON_CONTENT_TYPE
        )
        response.force_close()
        return response


class _NodeServer(web.Server):
    """Connections start in the fast lane (adds), which hands them to aiohttp's request
    handler at their first other request; past max_connections they are refused."""

    lanes: Lanes | None
    limit: ConnectionLimit

    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]
        if self.limit.full():
            return self.limit.refusal()
        if self.lanes is not None:
            return FastLane(self.lanes)
        return self.aiohttp_handler()

    def aiohttp_handler(self) -> RequestHandler:
        return _JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class NodeRunner(web.AppRunner):
    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, header_timeout=app[SETTINGS].header_timeout_s, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp builds the Server privately; swapping in the subclass (same layout)
        # is the one place to change the protocol of its connections.
        server.__class__ = _NodeServer
        assert isinstance(server, _NodeServer)
        server.limit = ConnectionLimit(
            self.app[SETTINGS].max_connections, server._connections, self.app[METRICS]
        )
        server.lanes = (
            Lanes(self.app, server._connections, server.aiohttp_handler)
            if self.app[SETTINGS].http_fast_lane_max_body
            else None
        )
        return server


async def serve(
    settings: Settings, sockets: list[socket.socket] | None = None, cookie: Cookie | None = None
) -> None:
    """Run until SIGTERM or SIGINT; then readiness fails at once, the listener closes,
    in-flight requests finish (up to shutdown_timeout_s), the storage checkpoints and
    closes its files. ``sockets``: from listen_sockets (default: bound here). With a
    metadata store, the node registers once it listens and leaves first when it stops."""
    if sockets is None:
        sockets = runtime.listen_sockets(settings.http_host, settings.http_port)
    app = build_app(settings, cookie=cookie)
    runner = NodeRunner(
        app, handle_signals=False, access_log=None, shutdown_timeout=settings.shutdown_timeout_s
    )
    await runner.setup()
    port = sockets[0].getsockname()[1]  # before the server owns the socket
    for sock in sockets:
        await web.SockSite(runner, sock).start()
    log.info(
        "listening on http://%s:%s, data in %s",
        settings.http_host,
        settings.http_port,
        settings.data_dir,
    )
    replication = app.get(REPLICATION)
    if replication is not None:
        await replication.register(port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    app[SERVING].shutting_down = True
    if replication is not None and replication.registration is not None:
        await replication.registration.stop()  # clients stop choosing it before it stops
    log.info("shutting down: finishing requests, then a final checkpoint")
    await runner.cleanup()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(Exception):
            loop.remove_signal_handler(sig)
    log.info("stopped cleanly")
