"""How the node's processes run: the event loop, the garbage collector, the GIL."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import logging
import resource
import signal
import socket
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from node.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

# The hot path allocates many short-lived containers (futures, tuples, dicts); with the
# default first-generation threshold (700) the collector runs hundreds of times a second
# and walks everything alive. Payloads are bytes, which it never tracks anyway.
GC_GENERATION0_THRESHOLD = 50_000
# CPython hands the GIL over every 5 ms by default: a busy background thread (compaction
# scanning a log, a checkpoint encoding records) then holds the event loop up to 5 ms at a
# time, which bench gc sees in the writers' p99. 1 ms bounds that wait.
GIL_SWITCH_INTERVAL_S = 0.001


# Descriptors the node's files take beside the entry log readers (open_file_limit): the
# journal, the entry log being written, RocksDB's tables and WAL, the listening socket, the
# event loop's and the thread pools' own. About 30 at start; the rest is headroom.
FILES_MARGIN = 128


def raise_open_files_limit() -> int:
    """Raise the soft limit on open files to the hard one, as servers do (systemd starts
    services at 1,024, with a hard limit of 524,288); the limit now in effect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:
        log.warning("cannot raise the open files limit from %d to %d: %s", soft, hard, e)
        return soft
    return hard


def fit_connections(settings: Settings, open_files: int) -> Settings:
    """``settings`` with max_connections lowered (when not set explicitly) so that the
    connections cannot take the descriptors the node's files need."""
    room = max(1, open_files - settings.open_file_limit - FILES_MARGIN)
    if settings.max_connections <= room:
        return settings
    if "max_connections" in settings.model_fields_set:
        log.warning(
            "max_connections %d leaves too few of the %d open files allowed for the node's "
            "own (open_file_limit %d, and %d more): raise the limit (LimitNOFILE=) or "
            "lower max_connections to %d",
            settings.max_connections,
            open_files,
            settings.open_file_limit,
            FILES_MARGIN,
            room,
        )
        return settings
    log.warning(
        "max_connections lowered to %d (default %d): the process may open %d files, and "
        "open_file_limit (%d) and %d more are the node's own",
        room,
        settings.max_connections,
        open_files,
        settings.open_file_limit,
        FILES_MARGIN,
    )
    values = {**settings.model_dump(), "max_connections": room}
    return Settings.model_construct(_fields_set=settings.model_fields_set, **values)


def tune() -> None:
    """Freeze what exists after start-up (modules, settings) out of collections, make
    young-generation collections rarer, and hand the GIL over more often."""
    gc.collect()
    gc.freeze()
    _gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GENERATION0_THRESHOLD, gen1, gen2)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


def dump_stacks_on_sigquit() -> None:
    """``kill -QUIT`` prints every thread's stack to stderr and the node goes on, as a JVM
    bookie does for ``jstack``: the way to see where a node that stopped answering is stuck
    (faulthandler writes from the signal handler itself, so a blocked event loop still dumps)."""
    faulthandler.register(signal.SIGQUIT, all_threads=True, chain=False)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    result: T = uvloop.run(coro)
    return result


class PortInUse(Exception):
    """The listen address is taken (or not this host's); the message says what to do."""


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound sockets for every address of ``host`` (as asyncio's create_server binds them),
    made before the node writes anything: a port in use refuses the start up front instead
    of after the storage has created its files."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PortInUse(f"cannot resolve the listen address {host!r}: {e.strerror}") from None
    bound: list[socket.socket] = []
    for family, kind, proto, _, address in dict.fromkeys(infos):
        sock = socket.socket(family, kind, proto)
        bound.append(sock)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
        except OSError as e:
            for s in bound:
                s.close()
            raise PortInUse(
                f"cannot listen on {address[0]} port {port}: {e.strerror}; stop what holds it "
                "or choose another port (--port, NODE_HTTP_PORT)"
            ) from None
    return bound
