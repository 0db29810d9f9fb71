"""What a node with a metadata store runs besides its storage: the store's connection, the
cookie it serves under, its registration and the replica GC sweep. node/http/app.py builds
one only when ``metadata_url`` is set (importing this module imports node.client)."""

from __future__ import annotations

import logging
import time
from typing import Any

from node.client.errors import ClientError
from node.client.metadata.etcd import EtcdStore, parse_url
from node.client.metadata.store import MetadataStore
from node.client.model import NodeInfo
from node.metrics import Metrics
from node.replication import cookie as cookies
from node.replication.cookie import Cookie
from node.replication.fleet import FleetPoller
from node.replication.orphans import OrphanReclaim
from node.replication.reconcile import StoreGuard, Sweep
from node.replication.registration import Registration
from node.settings import Settings
from node.storage.clock import Clock
from node.storage.ledgers import LedgerStorage

log = logging.getLogger(__name__)


def open_store(settings: Settings) -> MetadataStore:
    parse_url(settings.metadata_url)  # a bad URL fails here, naming the form it wants
    return EtcdStore(settings.metadata_url, timeout_s=settings.metadata_timeout_s)


class Replication:
    def __init__(
        self,
        settings: Settings,
        storage: LedgerStorage,
        metrics: Metrics,
        clock: Clock,
        cookie: Cookie | None = None,
        store: MetadataStore | None = None,
    ) -> None:
        self._settings = settings
        self._storage = storage
        self._metrics = metrics
        self._clock = clock
        self.store = store or open_store(settings)
        self.cookie = cookie
        skipped = metrics.replication_gc_skipped
        self.guard = StoreGuard(
            self.store,
            lambda: self.cookie.cluster_id if self.cookie else None,
            settings.metadata_timeout_s,
            on_error=skipped.inc if skipped else lambda: None,
        )
        self.registration: Registration | None = None
        self.sweep: Sweep | None = None
        self.orphans: OrphanReclaim | None = None
        assert metrics.fleet is not None  # made with the store's other metrics
        self.fleet = FleetPoller(
            self.store,
            metrics.fleet,
            settings.autorecovery_poll_s,
            settings.metadata_timeout_s,
            settings.lost_node_recovery_delay_s,
            settings.status_fleet_cache_s,
        )
        self._started_ms = int(time.time() * 1000)
        if metrics.registration_up is not None:
            metrics.registration_up.set(0)

    async def check_cookie(self, required: bool = True) -> Cookie | None:
        """The cookie check, when the caller (python -m node serve) did not run it first.
        A mismatch always raises; an unreachable store raises only when ``required``."""
        if self.cookie is None:
            try:
                self.cookie = await cookies.check(self._settings, self.store)
            except ClientError as error:
                if required:
                    raise
                log.warning("cookie not checked (%s): no replica GC, no registration", error)
        return self.cookie

    async def start(self) -> None:
        """After the storage started: the autorecovery figures' polls and the replica GC
        sweep (registration waits for the listening sockets, ``register``)."""
        self.fleet.start()  # read-only: runs without the cookie too
        if await self.check_cookie(required=False) is None:
            return  # the guard refuses to confirm anything without the cookie's cluster
        skipped, reclaimed, orphans = (
            self._metrics.replication_gc_skipped,
            self._metrics.replication_gc_reclaimed,
            self._metrics.replication_gc_overreplicated,
        )
        self.orphans = OrphanReclaim(
            self._storage,
            self.guard,
            self._settings.id,
            self._settings.replication_overreplicated_grace_s,
            self._clock.now_ms,
            on_reclaim=orphans.inc if orphans else lambda: None,
            on_skip=skipped.inc if skipped else lambda: None,
        )
        self.sweep = Sweep(
            self._storage,
            self.guard,
            self._settings.replication_gc_interval_s,
            self._settings.replication_gc_grace_s,
            self._clock.now_ms,
            on_skip=skipped.inc if skipped else lambda: None,
            on_reclaim=reclaimed.inc if reclaimed else lambda: None,
            orphans=self.orphans,
        )
        self.sweep.start()

    async def register(self, port: int) -> None:
        """Put nodes/<id> once the node listens on ``port`` (its URL's, unless advertised)."""
        cookie = await self.check_cookie()
        assert cookie is not None  # required: raised otherwise
        settings = self._settings
        url = settings.advertised_url or f"http://{settings.http_host}:{port}"
        info = NodeInfo(
            node_id=settings.id,
            url=url,
            zone=settings.zone,
            instance_id=cookie.instance_id,
            started_ms=self._started_ms,
        )
        up, grants = self._metrics.registration_up, self._metrics.registrations
        self.registration = Registration(
            self.store,
            info,
            settings.registration_ttl_s,
            read_only=lambda: self._storage.read_only_reason is not None,
            on_change=(lambda registered: up.set(int(registered))) if up else lambda _: None,
            on_grant=grants.inc if grants else lambda: None,
        )
        await self.registration.start()

    async def stop(self) -> None:
        if self.registration is not None:
            await self.registration.stop()
        if self.sweep is not None:
            await self.sweep.stop()
        await self.fleet.stop()
        await self.store.close()

    def summary(self) -> dict[str, Any]:
        registration, cookie, sweep = self.registration, self.cookie, self.sweep
        return {
            "enabled": True,
            "nodeId": self._settings.id,
            "registered": bool(registration and registration.registered),
            "clusterId": cookie.cluster_id if cookie else None,
            "instanceId": cookie.instance_id if cookie else None,
            "zone": self._settings.zone,
            "url": registration.info.url if registration else None,
            "replicatedLedgers": len(self._storage.replicated_ledgers()),
            "lastRegistrationError": registration.last_error if registration else None,
            "gcSweeps": sweep.passes if sweep else 0,
            "gcReclaimed": sweep.reclaimed if sweep else 0,
            "gcOverreplicatedReclaimed": self.orphans.reclaimed if self.orphans else 0,
            "gcSkipped": self.guard.errors
            + (sweep.skipped if sweep else 0)
            + (self.orphans.skipped if self.orphans else 0),
            **self.fleet.summary(),
        }
