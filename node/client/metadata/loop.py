"""The compare-and-set update loop (BookKeeper's MetadataUpdateLoop): apply a
change to a key only while its predicate holds, re-reading and re-checking on every conflict.

Ours beyond BookKeeper: on etcd a change whose answer was lost (OutcomeUnknown) may have applied,
and a store that does not answer (StoreUnavailable) may come back. Both re-read and re-check the
predicate, which turns "unknown" into "done" or "do it again", a bounded number of times. So the
predicate must be false once the change is in (idempotent), or a lost answer repeats it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from node.client.errors import CasConflict, NoSuchKey, OutcomeUnknown, StoreUnavailable
from node.client.metadata.store import MetadataStore, Versioned

# Failed round trips (no answer, lost answer) tolerated in a row before the caller hears of it,
# and the pause between them: together they outlast an etcd restart or a leader election.
DEFAULT_ATTEMPTS = 20
DEFAULT_PAUSE_S = 0.5


async def read_with_retry(
    store: MetadataStore,
    key: str,
    *,
    attempts: int = DEFAULT_ATTEMPTS,
    pause_s: float = DEFAULT_PAUSE_S,
) -> Versioned | None:
    """A linearizable read that waits out a store that does not answer, ``attempts`` times."""
    for attempt in range(1, attempts + 1):
        try:
            return await store.get(key)
        except StoreUnavailable:
            if attempt == attempts:
                raise
            await asyncio.sleep(pause_s)
    raise AssertionError("unreachable: the last attempt returns or raises")


async def update(
    store: MetadataStore,
    key: str,
    local: Versioned | None,
    needs_update: Callable[[bytes], bool],
    transform: Callable[[bytes], bytes],
    *,
    attempts: int = DEFAULT_ATTEMPTS,
    pause_s: float = DEFAULT_PAUSE_S,
) -> Versioned:
    """Change ``key`` from ``local`` (None: read it first) by ``transform`` while
    ``needs_update`` holds; the value that satisfies the caller, at its revision. Conflicts are
    not bounded: each means another updater succeeded. NoSuchKey when the key is gone."""
    current = (
        local
        if local is not None
        else await read_with_retry(store, key, attempts=attempts, pause_s=pause_s)
    )
    failures = 0
    while True:
        if current is None:
            raise NoSuchKey(key)
        if not needs_update(current.value):
            return current
        try:
            return await store.cas(key, transform(current.value), current.revision)
        except CasConflict as conflict:
            current = conflict.current or await read_with_retry(
                store, key, attempts=attempts, pause_s=pause_s
            )
        except (StoreUnavailable, OutcomeUnknown):
            failures += 1
            if failures >= attempts:
                raise
            await asyncio.sleep(pause_s)
            current = await read_with_retry(store, key, attempts=attempts, pause_s=pause_s)
