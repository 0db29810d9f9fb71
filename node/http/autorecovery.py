"""Autorecovery routes: the auditor, one marker's re-replication, decommission, and the status,
run by this node through a Client over its replication service's metadata store (the Airflow
DAG calls them on any live node; its workers need no access to etcd).

Every POST names the store it means (``metadataUrl``, the DAG's Variable): a node of another
fleet refuses with 409 ``metadata_mismatch`` rather than act on its own store. A node without
a metadata store answers 404 ``replication_off``. node.client and node.autorecovery load on the
first call only: a node without a store never loads them."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from node.http import models
from node.http.errors import ApiError
from node.http.jsonreply import json_response
from node.http.state import SETTINGS
from node.storage.faults import Faults

if TYPE_CHECKING:
    from node.client import Client
    from node.client.metadata.store import MetadataStore
    from node.replication.service import Replication

routes = web.RouteTableDef()

REPLICATION_OFF = "replication_off"
METADATA_MISMATCH = "metadata_mismatch"


class Autorecovery:
    """The node's Client for autorecovery, over the store its replication service holds
    (made on first use, closed with the application)."""

    def __init__(
        self, replication: Replication, node_id: str, token: str | None, faults: Faults
    ) -> None:
        self.replication = replication
        self.faults = faults  # the worker's named crash points (tests)
        self._token = token  # its copies are replica adds: the fleet's admin token, if any
        self._client: Client | None = None
        self.worker_prefix = f"{node_id}/pid {os.getpid()}"  # the lock's holder, with a nonce

    def client(self) -> Client:
        if self._client is None:
            from node.client import Client

            self._client = Client(self.replication.store, token=self._token)
        return self._client

    @property
    def store(self) -> MetadataStore:
        return self.replication.store

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()  # its transport only: the store is the service's


AUTORECOVERY: web.AppKey[Autorecovery] = web.AppKey("autorecovery")


def install(app: web.Application, replication: Replication) -> None:
    settings = app[SETTINGS]
    token = settings.admin_token.get_secret_value() if settings.admin_token else None
    app[AUTORECOVERY] = Autorecovery(
        replication, settings.id, token, Faults.from_settings(settings)
    )

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        yield
        await app[AUTORECOVERY].close()

    app.cleanup_ctx.append(lifecycle)


def _service(request: web.Request) -> Autorecovery:
    found = request.app.get(AUTORECOVERY)
    if found is None:
        raise ApiError(404, REPLICATION_OFF, "this node has no metadata store (metadata_url)")
    return found


async def _same_store(request: web.Request, given: str) -> Autorecovery:
    """The service, once ``given`` names this node's store: the same key prefix, and when the
    endpoints differ, the same cluster id found there."""
    service = _service(request)
    from node.client.errors import ClientError, MetadataUrlError
    from node.client.metadata.etcd import EtcdStore, parse_url
    from node.client.model import CLUSTER_KEY

    settings = request.app[SETTINGS]
    try:
        endpoints, prefix = parse_url(given)
    except MetadataUrlError as error:
        raise ApiError(400, "invalid_metadata_url", str(error)) from None
    own_endpoints, own_prefix = parse_url(settings.metadata_url)
    if prefix != own_prefix:
        raise ApiError(
            409,
            METADATA_MISMATCH,
            f"this node's metadata store has the prefix {own_prefix}, not {prefix}",
        )
    if set(endpoints) == set(own_endpoints):
        return service
    cookie = service.replication.cookie
    theirs: str | None = None
    other = EtcdStore(given, timeout_s=settings.metadata_timeout_s)
    try:
        found = await other.get(CLUSTER_KEY)
        if found is not None:
            theirs = str(json.loads(found.value).get("clusterId"))
    except (ClientError, ValueError, AttributeError):
        theirs = None
    finally:
        await other.close()
    if cookie is None or theirs != cookie.cluster_id:
        raise ApiError(
            409,
            METADATA_MISMATCH,
            f"{given} holds cluster {theirs}, this node serves cluster "
            f"{cookie.cluster_id if cookie else None}",
        )
    return service


def _refusal(error: Exception) -> ApiError:
    """A stable code for what autorecovery raised: 409 when the cluster's state refuses (a
    fragment whose replicas disagree, no replacement node, the lock lost), 503 when the metadata
    store or the nodes did not answer."""
    from node.client.errors import MetadataError, NotEnoughNodes, error_code

    if isinstance(error, MetadataError):
        return ApiError(503, "metadata_unavailable", str(error))
    if isinstance(error, NotEnoughNodes):
        return ApiError(409, "not_enough_nodes", str(error))
    code = error_code(error)
    if code in ("replicas_disagree", "copy_mismatch", "lock_lost"):
        return ApiError(409, code, str(error))
    return ApiError(503, code, str(error))


@routes.post("/api/v1/autorecovery/audit")
async def audit(request: web.Request) -> web.Response:
    body = models.AUTORECOVERY_AUDIT.parse(await request.read())
    service = await _same_store(request, body["metadataUrl"])
    from node.autorecovery.auditor import audit as run
    from node.client.errors import ClientError

    delay = body.get("lostNodeRecoveryDelaySeconds")
    try:
        report = await run(
            service.client(),
            lost_node_delay_s=(
                request.app[SETTINGS].lost_node_recovery_delay_s if delay is None else delay
            ),
            check_ledgers=body.get("checkLedgers", False),
            check_replicas=body.get("checkReplicas", False),
        )
    except ClientError as error:
        raise _refusal(error) from None
    return json_response({**report.to_json(), "markers": report.markers})


@routes.post("/api/v1/autorecovery/rereplicate")
async def rereplicate(request: web.Request) -> web.Response:
    body = models.AUTORECOVERY_REREPLICATE.parse(await request.read())
    service = await _same_store(request, body["metadataUrl"])
    from node.autorecovery.worker import rereplicate as run
    from node.client.errors import ClientError

    settings = request.app[SETTINGS]
    try:
        result = await run(
            service.client(),
            body["ledgerId"],
            worker_id=f"{service.worker_prefix}/{uuid.uuid4().hex[:12]}",
            open_ledger_grace_s=settings.open_ledger_rereplication_grace_s,
            lock_ttl_s=settings.autorecovery_lock_ttl_s,
            faults=service.faults,
        )
    except ClientError as error:
        raise _refusal(error) from None
    return json_response(result.to_json())


@routes.post("/api/v1/autorecovery/decommission")
async def decommission(request: web.Request) -> web.Response:
    body = models.AUTORECOVERY_DECOMMISSION.parse(await request.read())
    service = await _same_store(request, body["metadataUrl"])
    from node.autorecovery.decommission import decommission as mark
    from node.autorecovery.decommission import still_needed
    from node.client.errors import ClientError

    try:
        await mark(service.client(), body["nodeId"])
        needed = await still_needed(service.client(), body["nodeId"])
    except ClientError as error:
        raise _refusal(error) from None
    return json_response({"nodeId": body["nodeId"], "stillNeeded": needed})


@routes.get("/api/v1/autorecovery/status")
async def status(request: web.Request) -> web.Response:
    service = _service(request)
    from node.autorecovery import markers
    from node.client.errors import ClientError
    from node.client.model import MetadataFormatError

    try:
        report = await markers.read_report(service.store)
        totals = await markers.read_totals(service.store)
        count = len(await service.store.range(markers.MARKERS_PREFIX))
    except ClientError as error:
        raise _refusal(error) from None
    except MetadataFormatError as error:
        raise ApiError(503, "metadata_unreadable", str(error)) from None
    document: dict[str, Any] = {
        "lastAudit": report.to_json() if report else None,
        "totals": totals.to_json(),
        "markers": count,
    }
    return json_response(document)
