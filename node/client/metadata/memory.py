"""The metadata store in memory, with etcd's semantics (one revision counter for the store,
a version per key, leases that expire): the twin of EtcdStore for unit tests and simulation.
The contract tests run against both."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

from node.client.errors import CasConflict, NoSuchKey
from node.client.metadata.store import LEDGER_ID_BASE, LEDGER_IDS_KEY, Change, Versioned

# How often a watch looks for leases that ended while nothing else touched the store.
WATCH_EXPIRY_POLL_S = 0.1


@dataclass
class _Entry:
    value: bytes
    mod_revision: int
    version: int
    lease: int | None


@dataclass
class _Lease:
    ttl_s: int
    deadline: float
    keys: set[str] = field(default_factory=set)


class MemoryStore:
    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        """``monotonic``: the seconds that leases expire by (a simulation passes its own)."""
        self._monotonic = monotonic
        self._kv: dict[str, _Entry] = {}
        self._leases: dict[int, _Lease] = {}
        self._revision = 0
        self._next_lease = 1
        self._log: list[Change] = []  # every change, for watches from any revision
        self._changed = asyncio.Event()

    def _expire(self) -> None:
        now = self._monotonic()
        for lease_id in [i for i, lease in self._leases.items() if lease.deadline <= now]:
            self._drop_lease(lease_id)

    def _drop_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        for key in lease.keys:
            entry = self._kv.get(key)
            if entry is not None and entry.lease == lease_id:
                self._remove(key)

    def _current(self, key: str) -> Versioned | None:
        self._expire()
        entry = self._kv.get(key)
        return None if entry is None else Versioned(entry.value, entry.mod_revision)

    def _record(self, change: Change) -> None:
        self._log.append(change)
        self._changed.set()  # wakes the watches that took this event before the change
        self._changed = asyncio.Event()

    def _remove(self, key: str) -> None:
        del self._kv[key]
        self._revision += 1
        self._record(Change(key, None, self._revision))

    def _put(self, key: str, value: bytes, lease: int | None) -> Versioned:
        if lease is not None and lease not in self._leases:
            raise NoSuchKey(f"lease {lease}")
        self._revision += 1
        old = self._kv.get(key)
        version = 1 if old is None else old.version + 1
        self._kv[key] = _Entry(value, self._revision, version, lease)
        if lease is not None:
            self._leases[lease].keys.add(key)
        self._record(Change(key, Versioned(value, self._revision), self._revision))
        return Versioned(value, self._revision)

    def _at(self, key: str, revision: int) -> None:
        current = self._current(key)
        if current is None:
            raise NoSuchKey(key)
        if current.revision != revision:
            raise CasConflict(key, current)

    async def get(self, key: str, *, linearizable: bool = True) -> Versioned | None:
        return self._current(key)

    async def range(self, prefix: str) -> list[tuple[str, Versioned]]:
        self._expire()
        return [
            (key, Versioned(e.value, e.mod_revision))
            for key, e in sorted(self._kv.items())
            if key.startswith(prefix)
        ]

    async def create(self, key: str, value: bytes, *, lease: int | None = None) -> Versioned:
        current = self._current(key)
        if current is not None:
            raise CasConflict(key, current)
        return self._put(key, value, lease)

    async def cas(self, key: str, value: bytes, revision: int) -> Versioned:
        self._at(key, revision)
        return self._put(key, value, self._kv[key].lease)

    async def delete(self, key: str, revision: int) -> None:
        self._at(key, revision)
        self._remove(key)

    async def commit(self, guards: Mapping[str, int], changes: Mapping[str, bytes | None]) -> int:
        self._expire()
        for key, expected in guards.items():
            current = self._current(key)
            if (current.revision if current else 0) != expected:
                raise CasConflict(key, current)
        # etcd's txn: every change at one new revision, none for deletes of absent keys
        changed = [key for key, value in changes.items() if value is not None or key in self._kv]
        if not changed:
            return self._revision
        self._revision += 1
        for key in changed:
            value = changes[key]
            if value is None:
                del self._kv[key]
                self._record(Change(key, None, self._revision))
                continue
            old = self._kv.get(key)
            version = 1 if old is None else old.version + 1
            self._kv[key] = _Entry(value, self._revision, version, None)
            self._record(Change(key, Versioned(value, self._revision), self._revision))
        return self._revision

    async def put(self, key: str, value: bytes, *, lease: int) -> Versioned:
        self._expire()
        return self._put(key, value, lease)

    async def grant_lease(self, ttl_s: int) -> int:
        lease_id = self._next_lease
        self._next_lease += 1
        self._leases[lease_id] = _Lease(ttl_s, self._monotonic() + ttl_s)
        return lease_id

    async def keepalive(self, lease: int) -> bool:
        self._expire()
        held = self._leases.get(lease)
        if held is None:
            return False
        held.deadline = self._monotonic() + held.ttl_s
        return True

    async def revoke(self, lease: int) -> None:
        self._expire()
        if lease in self._leases:
            self._drop_lease(lease)

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[Change]:
        seen = start_revision
        while True:
            changed = self._changed
            self._expire()
            fresh = [c for c in self._log if c.revision >= seen and c.key.startswith(prefix)]
            for change in fresh:
                yield change
                seen = change.revision + 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), WATCH_EXPIRY_POLL_S)

    async def next_id(self) -> int:
        self._put(LEDGER_IDS_KEY, b"", None)
        return LEDGER_ID_BASE + self._kv[LEDGER_IDS_KEY].version

    async def close(self) -> None:
        pass
