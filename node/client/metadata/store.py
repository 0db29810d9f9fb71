"""The metadata store's contract: versioned keys under one prefix, every change
conditional on a revision, leases for what must vanish with its owner, and the ledger id
allocator. Keys are names relative to the store's prefix; values are bytes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

# Fleet-wide ledger ids live above this, so they never meet a node's local ids, which grow from 0.
LEDGER_ID_BASE = 2**62

# The allocator's key: its version is the counter (one put per id, never deleted).
LEDGER_IDS_KEY = "ledger-ids"


@dataclass(frozen=True)
class Versioned:
    """A value and the revision of its last change (etcd's mod_revision): the R of a CAS."""

    value: bytes
    revision: int


@dataclass(frozen=True)
class Change:
    """A change seen by a watch: the key's new value, or None when it was deleted (by a delete
    or the end of its lease), at the store's revision of that change."""

    key: str
    value: Versioned | None
    revision: int


class MetadataStore(Protocol):
    async def get(self, key: str, *, linearizable: bool = True) -> Versioned | None:
        """The key's value, or None. Linearizable by default: a serializable read may be stale,
        which the GC check cannot afford."""

    async def range(self, prefix: str) -> list[tuple[str, Versioned]]:
        """Every key that starts with ``prefix``, in key order."""

    async def create(self, key: str, value: bytes, *, lease: int | None = None) -> Versioned:
        """Put only if the key does not exist (create_revision == 0); CasConflict otherwise."""

    async def cas(self, key: str, value: bytes, revision: int) -> Versioned:
        """Put only if the key is at ``revision``: CasConflict when it is elsewhere, NoSuchKey
        when it is gone."""

    async def delete(self, key: str, revision: int) -> None:
        """Delete only if the key is at ``revision`` (CasConflict, NoSuchKey as for cas)."""

    async def commit(self, guards: Mapping[str, int], changes: Mapping[str, bytes | None]) -> int:
        """Apply every change, or none, in one step: only if every guard key is at its
        revision (its mod revision; 0: the key must be absent). A change is a put (value) or a
        delete (None); a put leaves its key without a lease (it drops one the key had: leased
        keys are written by ``create``/``put``). Guard keys and changed keys are independent
        sets. Returns the store's revision of the commit: the new revision of every key put
        (when nothing changed, as for deletes of absent keys only, the store's revision now).

        A guard that fails raises CasConflict naming the first guard key (in the mapping's
        order) that differs, with ``current`` its value now, or None when the key is absent but
        a revision was expected: a guard against a key that is gone (deleted, or its lease
        ended) is a conflict like any other, never NoSuchKey. Nothing was written then.
        etcd takes at most 128 guards and 128 changes in one commit (its --max-txn-ops)."""

    async def put(self, key: str, value: bytes, *, lease: int) -> Versioned:
        """Put unconditionally under a lease (registrations: the owner's own key)."""

    async def grant_lease(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its keys vanish when it is not kept alive."""

    async def keepalive(self, lease: int) -> bool:
        """Renew the lease; False when it has expired already (re-grant and re-put)."""

    async def revoke(self, lease: int) -> None:
        """End the lease now and delete its keys (an expired lease is no error)."""

    def watch(self, prefix: str, start_revision: int) -> AsyncIterator[Change]:
        """Every change of a key under ``prefix`` from ``start_revision`` on, in revision order,
        as long as the caller reads. StoreUnavailable when the store goes away: watch again from
        the last revision seen + 1."""

    async def next_id(self) -> int:
        """A ledger id never returned before, greater than every earlier one: the
        allocator key's version, which only grows (one put per id; the key is never deleted)."""

    async def close(self) -> None: ...
