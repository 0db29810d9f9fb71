"""The metadata store on etcd, through its v3 JSON gateway over one aiohttp session: no gRPC
dependency (no native wheel), the same event loop and timeouts as the rest.

The gateway's ways: int64 fields are JSON strings, zero and false fields are omitted, keys and
values are base64. Failure semantics are ours: a refused connection tries the next endpoint
(nothing was sent); a change whose answer is lost is OutcomeUnknown (it may have applied); a read
that fails is StoreUnavailable."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from node.client.errors import (
    CasConflict,
    MetadataUrlError,
    NoSuchKey,
    OutcomeUnknown,
    RequestRefused,
    StoreUnavailable,
)
from node.client.metadata.store import LEDGER_ID_BASE, LEDGER_IDS_KEY, Change, Versioned

# Per request, connect to answer: a stopped etcd makes calls fail in this time, never hang.
DEFAULT_TIMEOUT_S = 5.0

URL_FORM = "etcd://host:port[,host:port...]/prefix"

# gRPC codes of a definite refusal: the request was not applied. Any other error of a change
# (Unavailable, DeadlineExceeded, "request timed out") may have applied.
_DEFINITE = frozenset({3, 5, 7, 9, 11, 16})  # InvalidArgument, NotFound, PermissionDenied,
# FailedPrecondition, OutOfRange, Unauthenticated
_NOT_FOUND = 5
_OUT_OF_RANGE = 11  # a watch from a compacted revision


def parse_url(url: str) -> tuple[list[str], str]:
    """(the gateway's base URLs, the key prefix) of ``etcd://h1:2379,h2:2379/storage``."""
    parts = urlsplit(url)
    if parts.scheme != "etcd":
        raise MetadataUrlError(f"{url!r}: the scheme must be etcd:// ({URL_FORM})")
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise MetadataUrlError(f"{url!r}: no user, query or fragment ({URL_FORM})")
    if not parts.netloc:
        raise MetadataUrlError(f"{url!r}: no endpoint ({URL_FORM})")
    endpoints = []
    for hostport in parts.netloc.split(","):
        host, colon, port = hostport.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise MetadataUrlError(f"{url!r}: endpoint {hostport!r} is not host:port ({URL_FORM})")
        endpoints.append(f"http://{hostport}")
    prefix = parts.path.strip("/")
    if not prefix:
        raise MetadataUrlError(
            f"{url!r}: a key prefix is required, so that clusters sharing an etcd never meet "
            f"({URL_FORM})"
        )
    return endpoints, f"/{prefix}/"


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"  # every key
    end[-1] += 1
    return bytes(end)


def _versioned(kv: dict[str, Any]) -> Versioned:
    return Versioned(_unb64(kv.get("value", "")), int(kv.get("mod_revision", "0")))


class EtcdStore:
    def __init__(self, url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._endpoints, self.prefix = parse_url(url)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._preferred = 0  # the endpoint that answered last: stick to it
        self._session: aiohttp.ClientSession | None = None

    def _key(self, key: str) -> bytes:
        return (self.prefix + key).encode()

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def _call(self, path: str, body: dict[str, Any], *, change: bool) -> dict[str, Any]:
        session = self._open()
        count = len(self._endpoints)
        for step in range(count):
            index = (self._preferred + step) % count
            endpoint = self._endpoints[index]
            try:
                async with session.post(endpoint + path, json=body) as resp:
                    status, raw = resp.status, await resp.read()
            except aiohttp.ClientConnectorError:
                continue  # not connected: nothing was sent, the next endpoint may answer
            except (TimeoutError, aiohttp.ClientError) as exc:
                lost = OutcomeUnknown if change else StoreUnavailable
                raise lost(f"{path} at {endpoint}: no answer ({exc!r})") from exc
            self._preferred = index
            return self._answer(path, endpoint, status, raw, change)
        raise StoreUnavailable(f"{path}: no endpoint of {self._endpoints} accepts connections")

    @staticmethod
    def _answer(path: str, endpoint: str, status: int, raw: bytes, change: bool) -> dict[str, Any]:
        try:
            answer = json.loads(raw)
        except ValueError:
            raise RequestRefused(
                f"{path} at {endpoint}: HTTP {status}, not JSON: {raw[:200]!r}", -1
            ) from None
        if status == 200 and "error" not in answer:
            return answer  # type: ignore[no-any-return]
        code = int(answer.get("code", -1))
        message = f"{path} at {endpoint}: {answer.get('message', answer)} (code {code})"
        if code in _DEFINITE:
            raise RequestRefused(message, code)
        raise (OutcomeUnknown if change else StoreUnavailable)(message)

    async def _txn(
        self, compare: dict[str, Any], success: list[dict[str, Any]], failure_range: bytes
    ) -> tuple[dict[str, Any], Versioned | None]:
        """Run a one-compare txn whose failure branch reads the key: (answer, the key's value
        when the compare failed)."""
        answer = await self._call(
            "/v3/kv/txn",
            {
                "compare": [compare],
                "success": success,
                "failure": [{"request_range": {"key": _b64(failure_range)}}],
            },
            change=True,
        )
        if answer.get("succeeded"):
            return answer, None
        kvs = answer["responses"][0]["response_range"].get("kvs", [])
        return answer, _versioned(kvs[0]) if kvs else None

    async def get(self, key: str, *, linearizable: bool = True) -> Versioned | None:
        answer = await self._call(
            "/v3/kv/range",
            {"key": _b64(self._key(key)), "serializable": not linearizable},
            change=False,
        )
        kvs = answer.get("kvs", [])
        return _versioned(kvs[0]) if kvs else None

    async def range(self, prefix: str) -> list[tuple[str, Versioned]]:
        full = self._key(prefix)
        answer = await self._call(
            "/v3/kv/range", {"key": _b64(full), "range_end": _b64(_prefix_end(full))}, change=False
        )
        strip = len(self.prefix.encode())
        return [
            (_unb64(kv["key"])[strip:].decode(), _versioned(kv)) for kv in answer.get("kvs", [])
        ]

    def _put_op(self, key: bytes, value: bytes, **extra: Any) -> dict[str, Any]:
        return {"request_put": {"key": _b64(key), "value": _b64(value), **extra}}

    async def create(self, key: str, value: bytes, *, lease: int | None = None) -> Versioned:
        full = self._key(key)
        extra = {} if lease is None else {"lease": str(lease)}
        try:
            answer, current = await self._txn(
                {"key": _b64(full), "target": "CREATE", "result": "EQUAL", "create_revision": "0"},
                [self._put_op(full, value, **extra)],
                full,
            )
        except RequestRefused as exc:
            raise self._lease_gone(exc, lease) from exc
        if current is not None or not answer.get("succeeded"):
            raise CasConflict(key, current)
        return Versioned(value, int(answer["header"]["revision"]))

    async def _conditional(self, key: str, revision: int, op: dict[str, Any]) -> dict[str, Any]:
        full = self._key(key)
        answer, current = await self._txn(
            {"key": _b64(full), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)},
            [op],
            full,
        )
        if not answer.get("succeeded"):
            raise NoSuchKey(key) if current is None else CasConflict(key, current)
        return answer

    async def cas(self, key: str, value: bytes, revision: int) -> Versioned:
        # ignore_lease: a put without a lease would detach the key from the one it has
        answer = await self._conditional(
            key, revision, self._put_op(self._key(key), value, ignore_lease=True)
        )
        return Versioned(value, int(answer["header"]["revision"]))

    async def delete(self, key: str, revision: int) -> None:
        await self._conditional(
            key, revision, {"request_delete_range": {"key": _b64(self._key(key))}}
        )

    def _guard(self, key: str, revision: int) -> dict[str, Any]:
        """The compare of one guard: absent (never created since its last delete) for 0, else
        at that mod revision (an absent key's is 0, so it fails)."""
        if revision == 0:
            return {
                "key": _b64(self._key(key)),
                "target": "CREATE",
                "result": "EQUAL",
                "create_revision": "0",
            }
        return {
            "key": _b64(self._key(key)),
            "target": "MOD",
            "result": "EQUAL",
            "mod_revision": str(revision),
        }

    async def commit(self, guards: Mapping[str, int], changes: Mapping[str, bytes | None]) -> int:
        # One txn: its compares are the guards, its success the changes, and its failure reads
        # every guard key, so that a conflict names the key and its value without a second
        # request (which could see a later state).
        success = [
            self._put_op(self._key(key), value)
            if value is not None
            else {"request_delete_range": {"key": _b64(self._key(key))}}
            for key, value in changes.items()
        ]
        answer = await self._call(
            "/v3/kv/txn",
            {
                "compare": [self._guard(key, revision) for key, revision in guards.items()],
                "success": success,
                "failure": [{"request_range": {"key": _b64(self._key(key))}} for key in guards],
            },
            change=True,
        )
        if answer.get("succeeded"):
            return int(answer["header"]["revision"])
        for (key, expected), response in zip(guards.items(), answer["responses"], strict=True):
            kvs = response["response_range"].get("kvs", [])
            current = _versioned(kvs[0]) if kvs else None
            if (current.revision if current else 0) != expected:
                raise CasConflict(key, current)
        raise AssertionError(f"etcd refused a commit whose guards all hold: {answer}")

    async def put(self, key: str, value: bytes, *, lease: int) -> Versioned:
        try:
            answer = await self._call(
                "/v3/kv/put",
                self._put_op(self._key(key), value, lease=str(lease))["request_put"],
                change=True,
            )
        except RequestRefused as exc:
            raise self._lease_gone(exc, lease) from exc
        return Versioned(value, int(answer["header"]["revision"]))

    @staticmethod
    def _lease_gone(exc: RequestRefused, lease: int | None) -> Exception:
        return NoSuchKey(f"lease {lease}") if exc.code == _NOT_FOUND else exc

    async def grant_lease(self, ttl_s: int) -> int:
        answer = await self._call("/v3/lease/grant", {"TTL": ttl_s}, change=True)
        return int(answer["ID"])

    async def keepalive(self, lease: int) -> bool:
        answer = await self._call("/v3/lease/keepalive", {"ID": str(lease)}, change=False)
        # an expired lease answers a result without TTL (the gateway omits the zero)
        return int(answer.get("result", {}).get("TTL", "0")) > 0

    async def revoke(self, lease: int) -> None:
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease)}, change=True)
        except RequestRefused as exc:
            if exc.code != _NOT_FOUND:
                raise

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[Change]:
        full = self._key(prefix)
        body = {
            "create_request": {
                "key": _b64(full),
                "range_end": _b64(_prefix_end(full)),
                "start_revision": str(start_revision),
            }
        }
        # the stream lasts as long as the caller reads: only the connection is timed
        timeout = aiohttp.ClientTimeout(total=None, connect=self._timeout.total)
        endpoint = self._endpoints[self._preferred]
        strip = len(self.prefix.encode())
        try:
            async with self._open().post(
                endpoint + "/v3/watch", json=body, timeout=timeout
            ) as resp:
                async for line in resp.content:
                    if not line.strip():
                        continue
                    result = self._answer("/v3/watch", endpoint, resp.status, line, False).get(
                        "result", {}
                    )
                    if "compact_revision" in result:
                        raise RequestRefused(
                            f"watch of {prefix!r} from {start_revision}: "
                            f"compacted up to {result['compact_revision']}",
                            _OUT_OF_RANGE,
                        )
                    if result.get("canceled"):
                        raise StoreUnavailable(f"watch of {prefix!r}: canceled by etcd: {result}")
                    for event in result.get("events", []):
                        kv = event["kv"]
                        key = _unb64(kv["key"])[strip:].decode()
                        revision = int(kv["mod_revision"])
                        value = None if event.get("type") == "DELETE" else _versioned(kv)
                        yield Change(key, value, revision)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise StoreUnavailable(f"watch of {prefix!r} at {endpoint}: {exc!r}") from exc
        raise StoreUnavailable(f"watch of {prefix!r} at {endpoint}: the stream ended")

    async def next_id(self) -> int:
        full = self._key(LEDGER_IDS_KEY)
        answer = await self._call(
            "/v3/kv/txn",
            {"success": [self._put_op(full, b""), {"request_range": {"key": _b64(full)}}]},
            change=True,
        )
        kv = answer["responses"][1]["response_range"]["kvs"][0]
        return LEDGER_ID_BASE + int(kv["version"])

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
