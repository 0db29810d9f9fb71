"""The node's registration: ``nodes/<id>`` (a ``NodeInfo``) under a lease of
``registration_ttl_s``, so that it vanishes when the node dies or loses the store.

Placement and discovery read it; nothing safe depends on it (fencing and the cookie do):
a registration may outlive its node by a lease, or be missing while the node serves.
A keepalive goes every TTL/3; a lease found expired (etcd restarted and lost it, or the node
was stopped longer than the TTL) is granted again and the value put again. A change of the
node's read-only state puts the value again. A graceful stop revokes the lease, so the node
leaves ``nodes/`` at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from node.client.errors import ClientError
from node.client.metadata.store import MetadataStore
from node.client.model import NodeInfo, NodeState, node_key
from node.replication.tasks import cancel_and_wait

log = logging.getLogger(__name__)

KEEPALIVES_PER_TTL = 3  # etcd's own clients renew at a third of the TTL
STATE_POLL_S = 0.5  # how soon a read-only change reaches nodes/<id>
REVOKE_TIMEOUT_S = 2.0  # a graceful stop waits no longer for the store (the lease ends anyway)


class Registration:
    def __init__(
        self,
        store: MetadataStore,
        info: NodeInfo,
        ttl_s: int,
        read_only: Callable[[], bool],
        on_change: Callable[[bool], None] = lambda up: None,
        on_grant: Callable[[], None] = lambda: None,
    ) -> None:
        self._store = store
        self._info = info
        self._ttl_s = ttl_s
        self._read_only = read_only
        self._on_change = on_change  # called with "registered" whenever it flips
        self._on_grant = on_grant  # called for every lease granted
        self._lease: int | None = None
        self._put_state: NodeState | None = None  # the state nodes/<id> holds, if registered
        self._task: asyncio.Task[None] | None = None
        self._confirmed = 0.0  # monotonic time the store last confirmed the lease
        self.registered = False
        self.last_error: str | None = None
        self.re_registrations = 0  # leases granted again after one expired or was lost

    @property
    def info(self) -> NodeInfo:
        return self._info

    def _state(self) -> NodeState:
        return NodeState.READONLY if self._read_only() else NodeState.WRITABLE

    def _set(self, registered: bool, error: str | None = None) -> None:
        if registered != self.registered:
            self._on_change(registered)
        self.registered = registered
        if error is not None:
            self.last_error = error

    async def start(self) -> None:
        """Register once now (errors are logged and retried by the loop), then keep it."""
        await self._register()
        self._task = asyncio.get_running_loop().create_task(
            self._keep(), name="replication-registration"
        )

    async def _register(self) -> None:
        """Grant a lease if there is none, and put the value under it."""
        try:
            if self._lease is None:
                self._lease = await self._store.grant_lease(self._ttl_s)
                self._on_grant()
            state = self._state()
            self._info = NodeInfo(
                node_id=self._info.node_id,
                url=self._info.url,
                zone=self._info.zone,
                state=state,
                instance_id=self._info.instance_id,
                started_ms=self._info.started_ms,
            )
            key = node_key(self._info.node_id)
            await self._store.put(key, self._info.encode(), lease=self._lease)
            self._put_state = state
            self._confirmed = time.monotonic()
            self._set(True)
        except ClientError as error:
            # A lease the store does not know (expired, or etcd lost it): grant a new one.
            self._lease = None
            self._put_state = None
            self._set(False, f"{type(error).__name__}: {error}")
            log.warning("registration of %s failed (retrying): %s", self._info.node_id, error)

    async def _keep(self) -> None:
        interval = self._ttl_s / KEEPALIVES_PER_TTL
        next_keepalive = time.monotonic() + interval
        while True:
            await asyncio.sleep(min(STATE_POLL_S, interval))
            if self._lease is None:
                self.re_registrations += 1
                await self._register()
                next_keepalive = time.monotonic() + interval
                continue
            if self._state() != self._put_state:
                log.info("node %s is now %s: registering again", self._info.node_id, self._state())
                await self._register()
            if time.monotonic() < next_keepalive:
                continue
            next_keepalive = time.monotonic() + interval
            try:
                alive = await self._store.keepalive(self._lease)
            except ClientError as error:
                # Unknown yet: the lease may still live. Try again at the next tick; if it
                # ended meanwhile, the keepalive says so and we register again. Past a TTL
                # without an answer it has ended, whatever the store says later.
                lapsed = time.monotonic() - self._confirmed > self._ttl_s
                self._set(self.registered and not lapsed, f"{type(error).__name__}: {error}")
                log.warning("keepalive of %s failed: %s", self._info.node_id, error)
                continue
            if alive:  # the lease holds, and with it the key: (again) registered
                self._confirmed = time.monotonic()
                self._set(True)
                continue
            log.warning("the lease of %s expired: registering again", node_key(self._info.node_id))
            self._lease = None
            self._set(False, "lease expired")

    async def stop(self) -> None:
        """Stop keeping the lease and revoke it: the node leaves nodes/ now."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                async with asyncio.timeout(REVOKE_TIMEOUT_S):
                    await self._store.revoke(lease)
            except (ClientError, TimeoutError) as error:
                log.warning("could not revoke the registration lease (it will expire): %s", error)
        self._set(False)
