"""How the node's processes run: the event loop, the garbage collector, the GIL."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# The hot path allocates many short-lived containers (futures, tuples, dicts); with the
# default first-generation threshold (700) the collector runs hundreds of times a second
# and walks everything alive. Payloads are bytes, which it never tracks anyway.
GC_GENERATION0_THRESHOLD = 50_000
# CPython hands the GIL over every 5 ms by default: a busy background thread (compaction
# scanning a log, a checkpoint encoding records) then holds the event loop up to 5 ms at a
# time, which bench gc sees in the writers' p99. 1 ms bounds that wait.
GIL_SWITCH_INTERVAL_S = 0.001


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
