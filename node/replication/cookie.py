"""The node's identity (BookKeeper's Cookie, BP-46): which cluster it belongs to, under which
id, and which *instance* of that id this data directory is.

A cookie ``{layout, clusterId, nodeId, instanceId, createdMs, walKind}`` is kept in three
places: ``cookies/<id>`` in the metadata store, ``<data_dir>/COOKIE`` and the header of every
journal file (the raw-device WAL's header has no room for it yet: see the check below). At
start, before the storage opens, they must agree (``check``); a data directory that was wiped,
replaced or belongs to another cluster would otherwise answer "no such entry" for entries it
acknowledged and forget the fences it journaled, and a recovery trusting it would close a
ledger short. The refusal says what to run: ``python -m node shell readd <id>`` recovers the
node's open ledgers, then ``retire`` drops its cookie, and the next start is a new instance.

At start (``check``; "WAL" is every journal header, or the ring's newest header):

| store cookie | data_dir/COOKIE | WAL ids      | action                                       |
|--------------|-----------------|--------------|----------------------------------------------|
| absent       | absent          | none         | new node: write local, then the store        |
| absent       | present         | = local/none | first start died between the writes: publish |
|              |                 |              | it (refused if the store is another cluster  |
|              |                 |              | or empty, or the instance was retired)       |
| present      | = store         | = local/none | normal start                                 |
| present      | absent          | any          | refuse: wiped or replaced; `shell readd`     |
| present      | != store        | any          | refuse, naming both instances and places     |
| any          | any             | != local     | refuse, naming the WAL file and both ids     |
| (no store)   | present         | any          | refuse: NODE_METADATA_URL is missing         |

This module imports nothing of ``node.client`` until a store is needed: a node without a
metadata store reads only the local file (the node gives the WAL its instance id).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.storage.fsutil import write_file_atomically
from node.storage.journalformat import NO_INSTANCE
from node.storage.walid import wal_instances

if TYPE_CHECKING:
    from node.client.metadata.store import MetadataStore, Versioned
    from node.settings import Settings

log = logging.getLogger(__name__)

LAYOUT = 1
COOKIE_FILE = "COOKIE"  # in the data directory
RETIRED_PREFIX = "retired/"  # retired/<id>/<instanceId>: instances `shell readd` dropped
READD = "python -m node shell readd {node_id}"


class CookieRefused(Exception):
    """The data directory, its WAL and the metadata store disagree on who this node is (or
    cannot be asked): the node must not serve. The message says what differs and what to do."""


@dataclass(frozen=True)
class Cookie:
    cluster_id: str
    node_id: str
    instance_id: str  # a uuid4, new for every data directory a node id ever had
    created_ms: int
    wal_kind: str
    layout: int = LAYOUT

    def encode(self) -> bytes:
        value = {
            "layout": self.layout,
            "clusterId": self.cluster_id,
            "nodeId": self.node_id,
            "instanceId": self.instance_id,
            "createdMs": self.created_ms,
            "walKind": self.wal_kind,
        }
        return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()

    @staticmethod
    def decode(data: bytes, where: str) -> Cookie:
        try:
            raw = json.loads(data)
            cookie = Cookie(
                cluster_id=str(raw["clusterId"]),
                node_id=str(raw["nodeId"]),
                instance_id=str(uuid.UUID(str(raw["instanceId"]))),
                created_ms=int(raw["createdMs"]),
                wal_kind=str(raw.get("walKind", "")),
                layout=int(raw["layout"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CookieRefused(f"{where} is not a cookie ({error}); restore it") from None
        if cookie.layout != LAYOUT:
            raise CookieRefused(f"{where}: cookie layout {cookie.layout} is not {LAYOUT}")
        return cookie

    @property
    def instance_bytes(self) -> bytes:
        return uuid.UUID(self.instance_id).bytes

    def since(self) -> str:
        return datetime.fromtimestamp(self.created_ms / 1000, UTC).isoformat(timespec="seconds")


# --- the local file (no store) ------------------------------------------------------------


def local_path(data_dir: Path) -> Path:
    return data_dir / COOKIE_FILE


def read_local(data_dir: Path) -> Cookie | None:
    path = local_path(data_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return Cookie.decode(data, str(path))


def write_local(data_dir: Path, cookie: Cookie) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)  # the node's lock made it; an in-process app not
    write_file_atomically(local_path(data_dir), cookie.encode())


def instance_id_bytes(data_dir: Path) -> bytes:
    """The 16 bytes new journal headers carry: the local cookie's instance, zeros without."""
    try:
        cookie = read_local(data_dir)
    except CookieRefused:
        cookie = None  # the start's check refused it already; a header must not guess
    return cookie.instance_bytes if cookie else NO_INSTANCE


# --- the check at start -------------------------------------------------------------------


def _refuse_wal(cookie: Cookie | None, wal: list[tuple[str, str]], data_dir: Path) -> None:
    for path, instance in wal:
        if cookie is None:
            raise CookieRefused(
                f"WAL {path} belongs to instance {instance} but {local_path(data_dir)} is "
                "missing: the data directory was partly wiped or mixed with another node's; "
                "restore its COOKIE, or give the node an empty WAL"
            )
        if instance != cookie.instance_id:
            raise CookieRefused(
                f"WAL {path} belongs to instance {instance} but {local_path(data_dir)} "
                f"names instance {cookie.instance_id} (node {cookie.node_id}): that WAL is "
                "another data directory's; put the right volumes together"
            )


def check_without_store(settings: Settings) -> None:
    """A node without ``metadata_url`` must not hold a cookie: it would serve a replica's
    ledgers as its own and never ask the store before deleting them."""
    cookie = read_local(settings.data_dir)
    if cookie is not None:
        raise CookieRefused(
            f"{local_path(settings.data_dir)} says this data directory is instance "
            f"{cookie.instance_id} of node {cookie.node_id} in cluster {cookie.cluster_id}, "
            "but NODE_METADATA_URL is not set: start it with its metadata store "
            "(NODE_METADATA_URL), or give this node an empty data directory"
        )
    _refuse_wal(None, wal_instances(settings), settings.data_dir)


async def _cluster(store: MetadataStore, create: bool) -> str | None:
    """The store's cluster id, created once (create_revision == 0) when ``create``."""
    from node.client.errors import CasConflict
    from node.client.model import CLUSTER_KEY

    found = await store.get(CLUSTER_KEY)
    if found is None and create:
        value = {"clusterId": str(uuid.uuid4()), "layout": LAYOUT, "createdMs": _now_ms()}
        with contextlib.suppress(CasConflict):  # another node made it first: theirs it is
            await store.create(CLUSTER_KEY, json.dumps(value, sort_keys=True).encode())
        found = await store.get(CLUSTER_KEY)
    if found is None:
        return None
    try:
        return str(json.loads(found.value)["clusterId"])
    except (ValueError, KeyError, TypeError) as error:
        raise CookieRefused(f"the store's {CLUSTER_KEY} key is not a cluster ({error})") from None


def _now_ms() -> int:
    return int(time.time() * 1000)


def _store_name(settings: Settings, key: str) -> str:
    return f"{key} in {settings.metadata_url}"


async def check(settings: Settings, store: MetadataStore) -> Cookie:
    """The cookie this data directory serves under, made if it is a new node; CookieRefused
    when the places disagree (the table of the module docstring)."""
    import asyncio

    from node.client.model import cookie_key

    node_id, data_dir = settings.id, settings.data_dir
    local = await asyncio.to_thread(read_local, data_dir)
    wal = await asyncio.to_thread(wal_instances, settings)
    key = cookie_key(node_id)
    remote_value = await store.get(key)
    remote = Cookie.decode(remote_value.value, _store_name(settings, key)) if remote_value else None
    readd = READD.format(node_id=node_id)

    if local is not None and local.node_id != node_id:
        raise CookieRefused(
            f"{local_path(data_dir)} belongs to node {local.node_id} (instance "
            f"{local.instance_id}) but this node is {node_id} (NODE_ID): start it as "
            f"{local.node_id}, or give node {node_id} its own data directory"
        )
    if remote is not None and local is None:
        raise CookieRefused(
            f"the data directory of node {node_id} ({data_dir}) has no cookie but the metadata "
            f"store has instance {remote.instance_id} of it since {remote.since()} "
            f"({_store_name(settings, key)}): the volume was wiped or replaced, and the entries "
            f"it held are gone. To bring it back empty: `{readd}`"
        )
    if remote is not None and local is not None:
        if (local.instance_id, local.cluster_id) != (remote.instance_id, remote.cluster_id):
            raise CookieRefused(
                f"node {node_id}: {local_path(data_dir)} names instance {local.instance_id} of "
                f"cluster {local.cluster_id}, but {_store_name(settings, key)} names instance "
                f"{remote.instance_id} of cluster {remote.cluster_id}: this data directory is "
                f"not the one the store knows. Put the right volume back, or, to start it "
                f"empty as a new instance, wipe it and run `{readd}`"
            )
        _refuse_wal(local, wal, data_dir)
        cluster = await _cluster(store, create=False)
        if cluster != local.cluster_id:
            raise CookieRefused(
                f"node {node_id} is in cluster {local.cluster_id} but the store at "
                f"{settings.metadata_url} holds cluster {cluster}: wrong NODE_METADATA_URL?"
            )
        return local  # the normal start

    if local is not None:  # the store has no cookie of this node
        _refuse_wal(local, wal, data_dir)
        cluster = await _cluster(store, create=False)
        if cluster != local.cluster_id:
            raise CookieRefused(
                f"{local_path(data_dir)} names cluster {local.cluster_id} but the store at "
                f"{settings.metadata_url} holds "
                f"{'no cluster' if cluster is None else f'cluster {cluster}'}: a wrong "
                "NODE_METADATA_URL (prefix), or a data directory of another cluster. Point the "
                "node at its own store; nothing was written"
            )
        retired = await store.get(f"{RETIRED_PREFIX}{node_id}/{local.instance_id}")
        if retired is not None:
            raise CookieRefused(
                f"instance {local.instance_id} of node {node_id} was retired (`{readd}`): its "
                f"ledgers were recovered without it. Wipe {data_dir} to start as a new instance"
            )
        # The first start died between the local write and the store's: finish it.
        log.warning("cookie of %s is in %s only: publishing it", node_id, local_path(data_dir))
        await _publish(store, key, local, settings)
        return local

    # A new node (or a node that had no store until now: its ledgers stay local).
    _refuse_wal(None, wal, data_dir)
    cluster = await _cluster(store, create=True)
    assert cluster is not None
    cookie = Cookie(
        cluster_id=cluster,
        node_id=node_id,
        instance_id=str(uuid.uuid4()),
        created_ms=_now_ms(),
        wal_kind=settings.wal_kind,
    )
    # Local first: a crash before the store's write is the row above, never a store cookie
    # without its data directory (which would look wiped).
    await asyncio.to_thread(write_local, data_dir, cookie)
    await _publish(store, key, cookie, settings)
    log.info("new cookie: node %s, instance %s, cluster %s", node_id, cookie.instance_id, cluster)
    return cookie


async def _publish(store: MetadataStore, key: str, cookie: Cookie, settings: Settings) -> None:
    from node.client.errors import CasConflict, OutcomeUnknown

    try:
        await store.create(key, cookie.encode())
        return
    except (CasConflict, OutcomeUnknown):
        found: Versioned | None = await store.get(key)
    if found is not None and found.value == cookie.encode():
        return  # ours: the answer was lost
    other = Cookie.decode(found.value, _store_name(settings, key)) if found else None
    raise CookieRefused(
        f"node {settings.id}: another instance ({other.instance_id if other else 'none'}) "
        f"registered {_store_name(settings, key)} while this one ({cookie.instance_id}) "
        "started: two nodes share NODE_ID? Give each its own"
    )


# --- retiring an instance (`shell readd`, after its open ledgers are recovered) ----------


async def retire(store: MetadataStore, node_id: str) -> Cookie | None:
    """Drop ``cookies/<id>`` (CAS on the revision read) and record ``retired/<id>/<instance>``
    so that the old data directory can never come back; the next start of ``node_id`` is a
    new instance. Returns the retired cookie, or None when there was none. The caller must
    first have recovered every open ledger whose last segment names the node."""
    from node.client.errors import CasConflict
    from node.client.model import cookie_key

    key = cookie_key(node_id)
    found = await store.get(key)
    if found is None:
        return None
    cookie = Cookie.decode(found.value, key)
    retired_key = f"{RETIRED_PREFIX}{node_id}/{cookie.instance_id}"
    record: dict[str, Any] = {**json.loads(cookie.encode()), "retiredMs": _now_ms()}
    with contextlib.suppress(CasConflict):  # a readd that stopped before its delete
        await store.create(retired_key, json.dumps(record, sort_keys=True).encode())
    await store.delete(key, found.revision)
    return cookie
