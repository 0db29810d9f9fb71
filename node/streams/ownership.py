"""One node's ownership of replicated streams: ``stream-owners/<name>`` in the metadata store,
``{"v": 1, "node", "url", "sinceMs"}``, created if absent under ONE lease of the node's
(TTL ``stream_owner_ttl_s``), so that every stream of a node that dies or loses the store is
free again one TTL later, and every stream of a node that stops is free at once (its lease is
revoked).

The owner key's revision, as its create returned it, is the owner's guard: every write of the
owner is a ``MetadataStore.commit`` guarded by ``guard(name)``, so once the key is gone (the
lease ended) or another node created it anew, the old owner can write nothing, whatever it
believes. Ownership itself is only the node's belief, kept as safe as it can be:

- a keepalive goes every TTL/3; one that finds the lease expired drops every owned stream;
- a keepalive that gets no answer (a store outage, a partition) keeps the streams, but once a
  TTL has passed since the last keepalive the store confirmed (counted from when it was sent,
  so never later than etcd's own deadline), every stream is dropped: another node may own
  them by then;
- each drop calls ``on_lost`` with the names, and a new lease is granted for later acquires.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from node.client.errors import CasConflict, ClientError, NoSuchKey, StoreUnavailable
from node.client.metadata.store import MetadataStore
from node.replication.tasks import cancel_and_wait

log = logging.getLogger(__name__)

OWNERS_PREFIX = "stream-owners/"
FORMAT_VERSION = 1
KEEPALIVES_PER_TTL = 3  # etcd's own clients renew at a third of the TTL
REVOKE_TIMEOUT_S = 2.0  # a graceful stop waits no longer for the store (the lease ends anyway)
# An acquire retries when the key or the lease changed under it (deleted between the create and
# the read, the lease ended): a few rounds, then the store is called unavailable for now.
ACQUIRE_ATTEMPTS = 3


def owner_key(name: str) -> str:
    return f"{OWNERS_PREFIX}{name}"


def _wall_ms() -> int:
    return int(time.time() * 1000)


class OwnerFormatError(ValueError):
    """An owner key's value that is not ``{"v": 1, "node", "url", "sinceMs"}``."""


class NotOwner(KeyError):
    """This node does not own the stream (never acquired, released, or lost)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:  # KeyError's would quote the name as a repr
        return f"stream {self.name}: not owned by this node"


@dataclass(frozen=True)
class Owner:
    """Who owns a stream: the node, the URL to forward its requests to, since when (ms since
    the epoch), and the owner key's revision (the owner's guard)."""

    node: str
    url: str
    since_ms: int
    revision: int

    @staticmethod
    def encode(node: str, url: str, since_ms: int) -> bytes:
        return json.dumps(
            {"v": FORMAT_VERSION, "node": node, "url": url, "sinceMs": since_ms},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, raw: bytes, revision: int) -> Owner:
        try:
            doc = json.loads(raw)
            if doc["v"] != FORMAT_VERSION:
                raise OwnerFormatError(f"owner format {doc['v']!r}, not {FORMAT_VERSION}")
            node, url, since_ms = doc["node"], doc["url"], doc["sinceMs"]
        except (ValueError, KeyError, TypeError) as exc:
            raise OwnerFormatError(f"not an owner value: {raw[:200]!r} ({exc})") from exc
        if not isinstance(node, str) or not isinstance(url, str) or not isinstance(since_ms, int):
            raise OwnerFormatError(f"not an owner value: {raw[:200]!r}")
        return cls(node, url, since_ms, revision)


class Ownership:
    def __init__(
        self,
        store: MetadataStore,
        node_id: str,
        url: str,
        ttl_s: int,
        clock_ms: Callable[[], int] = _wall_ms,
        on_lost: Callable[[list[str]], None] = lambda names: None,
    ) -> None:
        """``clock_ms``: the wall clock of ``sinceMs``. ``on_lost`` (may be set later): called
        with the names of streams this node no longer owns without having released them."""
        self._store = store
        self.node_id = node_id
        self.url = url
        self._ttl_s = ttl_s
        self._clock_ms = clock_ms
        self.on_lost = on_lost
        self.owned: dict[str, int] = {}  # name -> the owner key's revision: the guard
        self.takeovers = 0  # acquires that created the owner key
        self.last_error: str | None = None  # the last keepalive's failure, for the status page
        self._lease: int | None = None
        self._confirmed = 0.0  # monotonic time a keepalive the store confirmed was sent
        # released while the store did not answer: deleted at a later keepalive
        self._unreleased: dict[str, int] = {}
        self._granting = asyncio.Lock()
        self._acquiring: dict[str, asyncio.Lock] = {}  # one acquire of a name at a time
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Grant the lease (a store that does not answer now is retried by the keepalive and by
        the first acquire) and keep it alive."""
        try:
            await self._lease_now()
        except ClientError as error:
            self.last_error = f"{type(error).__name__}: {error}"
            log.warning("no stream owner lease yet (retrying): %s", error)
        self._task = asyncio.get_running_loop().create_task(self._keep(), name="stream-ownership")

    async def stop(self) -> None:
        """Stop keeping the lease and revoke it: every owner key of this node vanishes now, so
        other nodes take the streams over at once. ``on_lost`` is not called: the caller is the
        one stopping."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        lease, self._lease = self._lease, None
        self.owned.clear()
        self._unreleased.clear()
        if lease is not None:
            try:
                async with asyncio.timeout(REVOKE_TIMEOUT_S):
                    await self._store.revoke(lease)
            except (ClientError, TimeoutError) as error:
                log.warning("could not revoke the stream owner lease (it will expire): %s", error)

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    async def owner(self, name: str) -> Owner | None:
        """Who owns ``name`` now (a linearizable read), or None. It may name this node for a
        stream it does not own: a key of a lease this node gave up, until etcd ends it (an
        acquire here replaces it). OwnerFormatError for a value that is not an owner's."""
        found = await self._store.get(owner_key(name))
        return None if found is None else Owner.decode(found.value, found.revision)

    async def acquire(self, name: str) -> int | None:
        """Own ``name``: the owner key's revision (the guard of every later write), or None when
        another node owns it. A stream this node owns already answers its guard at once.

        A key that names this node but is not owned (of a lease given up: a restart, a lost
        lease, a create whose answer was lost, a release the store did not answer) is deleted
        at its revision and created anew: the caller takes the stream over as from any node."""
        if name in self.owned:
            return self.owned[name]
        async with self._acquiring.setdefault(name, asyncio.Lock()):
            for _attempt in range(ACQUIRE_ATTEMPTS):
                if name in self.owned:  # a concurrent acquire got it while this one waited
                    return self.owned[name]
                revision = await self._create(name)
                if revision is None:
                    return None
                if revision > 0:
                    self.owned[name] = revision
                    self._unreleased.pop(name, None)
                    self.takeovers += 1
                    return revision
        raise StoreUnavailable(f"{owner_key(name)}: the key or the lease kept changing")

    async def _create(self, name: str) -> int | None:
        """One try at creating the owner key: its revision, None when another node owns it,
        0 to try again."""
        key = owner_key(name)
        if self._lapsed():
            self._lose_all("no keepalive confirmed the lease for a TTL")
        lease = await self._lease_now()
        value = Owner.encode(self.node_id, self.url, self._clock_ms())
        try:
            made = await self._store.create(key, value, lease=lease)
        except NoSuchKey:  # the store knows the lease no more: it expired
            if lease == self._lease:
                self._lose_all("the lease expired")
            return 0
        except CasConflict as conflict:
            current = conflict.current
            if current is None:
                return 0  # deleted since: try again
            try:
                holder = Owner.decode(current.value, current.revision)
            except OwnerFormatError as error:
                log.error("%s: %s; leaving it to its lease", key, error)
                return None
            if holder.node != self.node_id:
                return None
            with contextlib.suppress(CasConflict, NoSuchKey):
                await self._store.delete(key, current.revision)
            return 0
        if lease != self._lease:
            return 0  # the lease was given up meanwhile: the key goes with it
        return made.revision

    def guard(self, name: str) -> dict[str, int]:
        """``{owner key: revision}`` for the guards of a commit of this stream's owner."""
        try:
            return {owner_key(name): self.owned[name]}
        except KeyError:
            raise NotOwner(name) from None

    def lost(self, name: str) -> None:
        """The caller found ``name`` lost (a commit failed on its owner key): forget it and
        tell ``on_lost``, the one place a stream's owner state is dropped."""
        if self.owned.pop(name, None) is not None:
            self._notify([name])

    async def release(self, name: str) -> None:
        """Give ``name`` up: forget it, and delete its key if it is still ours (a guarded
        delete). A store that does not answer leaves the key to a later keepalive."""
        revision = self.owned.pop(name, None)
        if revision is None:
            return
        try:
            await self._store.delete(owner_key(name), revision)
        except (CasConflict, NoSuchKey):
            pass  # not ours any more: nothing to release
        except ClientError as error:
            self._unreleased[name] = revision
            log.warning("%s: release deferred: %s", owner_key(name), error)

    async def _lease_now(self) -> int:
        async with self._granting:
            if self._lease is None:
                sent = time.monotonic()
                self._lease = await self._store.grant_lease(self._ttl_s)
                self._confirmed = sent
            return self._lease

    def _lapsed(self) -> bool:
        return self._lease is not None and time.monotonic() - self._confirmed >= self._ttl_s

    def _lose_all(self, why: str) -> None:
        names = sorted(self.owned)
        self.owned.clear()
        self._unreleased.clear()  # their keys end with the lease
        self._lease = None
        log.warning("stream owner lease lost (%s): dropping %d streams", why, len(names))
        if names:
            self._notify(names)

    def _notify(self, names: list[str]) -> None:
        try:
            self.on_lost(names)
        except Exception:
            log.exception("on_lost(%s) failed", names)

    async def _keep(self) -> None:
        interval = self._ttl_s / KEEPALIVES_PER_TTL
        while True:
            delay = interval
            if self._lease is not None:  # wake at the lease's deadline at the latest
                delay = min(interval, self._confirmed + self._ttl_s - time.monotonic())
            await asyncio.sleep(max(0.0, delay))
            await self._tick()

    async def _tick(self) -> None:
        if self._lease is None:
            try:
                await self._lease_now()  # ready for the next acquire
            except ClientError as error:
                self.last_error = f"{type(error).__name__}: {error}"
            return
        if self._lapsed():
            self._lose_all("no keepalive confirmed the lease for a TTL")
            return
        lease = self._lease
        sent = time.monotonic()
        try:
            # a keepalive that answers after the deadline could not save the streams anyway
            async with asyncio.timeout(self._confirmed + self._ttl_s - sent):
                alive = await self._store.keepalive(lease)
        except (ClientError, TimeoutError) as error:
            # Unknown yet: the lease may still live. Try again at the next tick.
            self.last_error = f"{type(error).__name__}: {error}"
            log.warning("stream owner keepalive failed: %s", error)
            return
        if lease != self._lease:
            return  # given up or replaced meanwhile
        if not alive:
            self._lose_all("the lease expired")
            return
        self._confirmed = sent
        self.last_error = None
        await self._release_deferred()

    async def _release_deferred(self) -> None:
        for name, revision in list(self._unreleased.items()):
            try:
                await self._store.delete(owner_key(name), revision)
            except (CasConflict, NoSuchKey):
                pass
            except ClientError:
                return  # the store is away again: at the next keepalive
            self._unreleased.pop(name, None)
