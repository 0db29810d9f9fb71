"""Multipart uploads that never completed (a node killed mid-upload): found and aborted.

obstore aborts an upload that fails, but a SIGKILL leaves it: on S3 its parts are kept (and
billed) out of sight of any listing of objects; the local store leaves its staging file
(``<key>#<n>``), which its listings skip. obstore cannot list either, so:

- S3: ListMultipartUploads and AbortMultipartUpload, signed here (AWS Signature V4) with the
  offload credentials (settings, else ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
  ``AWS_SESSION_TOKEN``). Without static credentials (an instance or IRSA role) the uploads
  cannot be listed here: the bucket lifecycle rule (README) aborts them.
- local: the staging files under the store's directory.

Keys are relative to the store's prefix, as the store's own listings give them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import hmac
import os
import re
import urllib.parse
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp

from node.settings import Settings

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
STAGING = re.compile(r"^(?P<key>.+)#(?P<upload>\d+)$")  # obstore's local staging file names


@dataclass(slots=True, frozen=True)
class IncompleteUpload:
    key: str
    upload_id: str


class StoreAnswered(OSError):
    """The store answered an error status (the text names it as obstore's messages do)."""


class Uploads(Protocol):
    available: bool

    async def find(self, prefix: str) -> list[IncompleteUpload]: ...

    async def abort(self, upload: IncompleteUpload) -> None: ...


class LocalUploads:
    """The local store's staging files."""

    available = True

    def __init__(self, root: Path) -> None:
        self._root = root

    async def find(self, prefix: str) -> list[IncompleteUpload]:
        return await asyncio.to_thread(self._find, prefix)

    def _find(self, prefix: str) -> list[IncompleteUpload]:
        found = []
        for path in self._root.rglob("*#*"):
            match = STAGING.match(path.relative_to(self._root).as_posix())
            if match and match["key"].startswith(prefix) and path.is_file():
                found.append(IncompleteUpload(match["key"], match["upload"]))
        return sorted(found, key=lambda u: (u.key, u.upload_id))

    async def abort(self, upload: IncompleteUpload) -> None:
        staging = self._root / f"{upload.key}#{upload.upload_id}"
        await asyncio.to_thread(staging.unlink, missing_ok=True)


@dataclass(slots=True, frozen=True)
class Credentials:
    key_id: str
    secret: str
    token: str | None


class S3Uploads:
    """ListMultipartUploads / AbortMultipartUpload of one bucket under one prefix."""

    def __init__(self, settings: Settings) -> None:
        env = os.environ
        self._region = (
            settings.offload_region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        ) or "us-east-1"
        endpoint = settings.offload_endpoint or f"https://s3.{self._region}.amazonaws.com"
        bucket = settings.offload_bucket
        parsed = urllib.parse.urlsplit(endpoint.rstrip("/"))
        if settings.offload_virtual_hosted_style:
            self._base = f"{parsed.scheme}://{bucket}.{parsed.netloc}{parsed.path}"
        else:
            self._base = f"{parsed.scheme}://{parsed.netloc}{parsed.path}/{bucket}"
        self._prefix = f"{settings.offload_prefix}/" if settings.offload_prefix else ""
        secret = settings.offload_secret_access_key
        key_id = settings.offload_access_key_id or env.get("AWS_ACCESS_KEY_ID")
        secret_text = secret.get_secret_value() if secret else env.get("AWS_SECRET_ACCESS_KEY")
        self.credentials = (
            Credentials(key_id, secret_text, env.get("AWS_SESSION_TOKEN"))
            if key_id and secret_text
            else None
        )
        self.available = self.credentials is not None

    async def find(self, prefix: str) -> list[IncompleteUpload]:
        found: list[IncompleteUpload] = []
        markers: dict[str, str] = {}
        while True:
            query = {"uploads": "", "prefix": self._prefix + prefix, **markers}
            root = ET.fromstring(await self._request("GET", "", query))
            for upload in root.iterfind("{*}Upload"):
                key = upload.findtext("{*}Key", "")
                upload_id = upload.findtext("{*}UploadId", "")
                found.append(IncompleteUpload(key.removeprefix(self._prefix), upload_id))
            if root.findtext("{*}IsTruncated", "false") != "true":
                return found
            markers = {
                "key-marker": root.findtext("{*}NextKeyMarker", ""),
                "upload-id-marker": root.findtext("{*}NextUploadIdMarker", ""),
            }

    async def abort(self, upload: IncompleteUpload) -> None:
        await self._request("DELETE", self._prefix + upload.key, {"uploadId": upload.upload_id})

    async def _request(self, method: str, key: str, query: dict[str, str]) -> bytes:
        assert self.credentials is not None  # else not available: never called
        url = f"{self._base}/{urllib.parse.quote(key, safe='/~')}" if key else self._base
        headers = sign(method, url, query, self._region, self.credentials, dt.datetime.now(dt.UTC))
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.request(method, url, params=query, headers=headers) as reply,
            ):
                body = await reply.read()
        except aiohttp.ClientConnectionError as e:
            raise ConnectionError(f"{method} {url}: {e}") from e
        if reply.status >= 300 and not (method == "DELETE" and reply.status == 404):
            detail = body[:300].decode(errors="replace")
            raise StoreAnswered(
                f"{method} {url} - Server returned non-2xx status code: {reply.status}: {detail}"
            )
        return body


def sign(
    method: str,
    url: str,
    query: dict[str, str],
    region: str,
    credentials: Credentials,
    now: dt.datetime,
) -> dict[str, str]:
    """The headers of an AWS Signature V4 request to S3 without a body."""
    parts = urllib.parse.urlsplit(url)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    headers = {
        "host": parts.netloc,
        "x-amz-content-sha256": EMPTY_SHA256,
        "x-amz-date": amz_date,
    }
    if credentials.token:
        headers["x-amz-security-token"] = credentials.token
    names = sorted(headers)
    canonical_query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(query.items()))
    canonical = "\n".join(
        [
            method,
            parts.path or "/",
            canonical_query,
            *(f"{name}:{headers[name]}" for name in names),
            "",
            ";".join(names),
            EMPTY_SHA256,
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = f"AWS4{credentials.secret}".encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={credentials.key_id}/{scope}, "
        f"SignedHeaders={';'.join(names)}, Signature={signature}"
    )
    del headers["host"]  # the client sends it
    return headers


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="-_.~")
