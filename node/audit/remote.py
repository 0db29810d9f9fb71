"""A snapshot a node serves over HTTP (GET /api/v1/audit/snapshots/{id}/...), read where
the audit runs: its metadata by the driver, its tables and byte ranges of its logs by the
executors, which need no access to the node's volume (on Kubernetes they have none).

urllib3, one pool per task (a task reads one range of one log, or one table, from one node):
a dropped connection or a 503 (the node's read budget full) is retried with backoff; a body
shorter than its Content-Range (a connection cut mid-reply) too. The admin token comes from
``NODE_ADMIN_TOKEN`` (the job sets it in the executors' environment). No pyspark here.
"""

from __future__ import annotations

import os
import time
from typing import Any

import urllib3

TOKEN_ENV = "NODE_ADMIN_TOKEN"  # the node's own setting: one secret for every side
SCHEMES = ("http://", "https://")
ATTEMPTS = 5  # a node restarting, a connection dropped: a few tries before the task fails
BACKOFF_S = 0.2  # doubled after each failed try
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0  # a paced range (audit_serve_bytes_per_s) of 8 MiB takes seconds
RETRY_STATUSES = frozenset({502, 503, 504})
STATUS_PARTIAL = 206
STATUS_OK = 200
STATUS_NOT_FOUND = 404
STATUS_UNSATISFIABLE = 416


class RemoteError(OSError):
    """The node did not serve the snapshot's file (status and its JSON error)."""


def is_url(location: str) -> bool:
    return location.startswith(SCHEMES)


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def pool() -> urllib3.PoolManager:
    """One per task: its connections are reused for every request of the task."""
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S),
        retries=False,  # ours below: they also cover a body cut short
    )


def _headers(extra: dict[str, str] | None = None) -> dict[str, str]:
    headers = dict(extra or {})
    token = os.environ.get(TOKEN_ENV)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def request(
    http: urllib3.PoolManager,
    method: str,
    url: str,
    headers: dict[str, str] | None = None,
    preload: bool = True,
) -> Any:
    """The response (its body read, unless not ``preload``: then the caller reads it and
    releases the connection), retried on a dropped connection and RETRY_STATUSES;
    FileNotFoundError on 404."""
    delay = BACKOFF_S
    for attempt in range(ATTEMPTS):
        try:
            response = http.request(method, url, headers=_headers(headers), preload_content=preload)
            if response.status in RETRY_STATUSES and attempt + 1 < ATTEMPTS:
                response.drain_conn()
                raise _Again(f"{response.status}")
            if response.status == STATUS_NOT_FOUND:
                raise FileNotFoundError(f"{url}: {response.data[:300]!r}")
            return response
        except (urllib3.exceptions.HTTPError, _Again) as e:
            if attempt + 1 == ATTEMPTS:
                raise RemoteError(f"{method} {url}: {e} ({ATTEMPTS} tries)") from None
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


class _Again(Exception):
    pass


def get(http: urllib3.PoolManager, url: str) -> bytes:
    """A whole file (a snapshot's metadata or table)."""
    response = request(http, "GET", url)
    if response.status != STATUS_OK:
        raise RemoteError(f"GET {url}: {response.status} {response.data[:300]!r}")
    return bytes(response.data)


class HttpLog:
    """``pread`` over HTTP byte ranges of one log a snapshot holds (node.audit.ranges)."""

    def __init__(self, http: urllib3.PoolManager, url: str) -> None:
        self.http = http
        self.url = url
        head = request(http, "HEAD", url)
        if head.status != STATUS_OK:
            raise RemoteError(f"HEAD {url}: {head.status}")
        self.size = int(head.headers["Content-Length"])

    def pread(self, length: int, offset: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (fewer at the end of the log)."""
        if offset >= self.size or length <= 0:
            return b""
        last = min(offset + length, self.size) - 1
        for _attempt in range(ATTEMPTS):
            response = request(
                self.http, "GET", self.url, {"Range": f"bytes={offset}-{last}"}, preload=False
            )
            try:
                if response.status == STATUS_UNSATISFIABLE:
                    return b""
                if response.status != STATUS_PARTIAL:
                    raise RemoteError(
                        f"GET {self.url} {offset}-{last}: {response.status} {response.data[:300]!r}"
                    )
                data = _body(response, last - offset + 1)
                if data is None:
                    response.close()  # what is left of the reply must not meet the next one
            finally:
                response.release_conn()
            if data is not None:
                return data
            time.sleep(BACKOFF_S)  # a body cut short: the connection dropped mid-reply
        raise RemoteError(f"GET {self.url} {offset}-{last}: short bodies ({ATTEMPTS} tries)")

    def close(self) -> None:
        """The pool is the task's: nothing of its own to close."""


def _body(response: Any, size: int) -> bytes | None:
    """The body's ``size`` bytes, or None when it ends short. One ``read(size)``: the
    socket's bytes land once in the bytes returned. A ``readinto`` through urllib3 reads
    into a fresh bytes object and copies it again, and the joined buffer once more: every
    pass over 8 MiB costs an executor about as much CPU as checking its CRCs (1.9 against
    0.35 s of CPU per GB of body on this machine, ``read`` being the latter)."""
    try:
        data = response.read(size)
    except urllib3.exceptions.HTTPError:
        return None
    return data if len(data) == size else None
