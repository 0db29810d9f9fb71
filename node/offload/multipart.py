"""Multipart uploads that never completed (a node killed mid-upload): found and aborted.

obstore aborts an upload that fails, but a SIGKILL leaves it: on S3 its parts are kept (and
billed) out of sight of any listing of objects; the local store leaves its staging file
(``<key>#<n>``), which its listings skip. obstore cannot list either, so:

- S3: ListMultipartUploads and AbortMultipartUpload over aiohttp, signed (AWS Signature V4)
  by botocore with the offload credentials of the settings, else botocore's chain (the
  ``AWS_*`` variables, shared files, an IRSA web identity, the instance's role), as the
  store's own client finds its own. Without any, the uploads cannot be listed here: the
  bucket lifecycle rule (docs/operations.md) aborts them.
- local: the staging files under the store's directory.

Keys are relative to the store's prefix, as the store's own listings give them.
"""

from __future__ import annotations

import asyncio
import os
import re
import urllib.parse
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import aiohttp
import yarl

from node.settings import Settings

if TYPE_CHECKING:
    from botocore.credentials import Credentials

# botocore (~0.1 s of imports) is imported by the S3 uploads alone: a node offloading to a
# local directory, or not at all, starts without it.

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


class S3Uploads:
    """ListMultipartUploads / AbortMultipartUpload of one bucket under one prefix. Made on a
    worker thread: finding the credentials may ask the instance's metadata service."""

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
        import botocore.session
        from botocore.credentials import Credentials

        secret = settings.offload_secret_access_key
        self._credentials: Credentials | None
        if settings.offload_access_key_id and secret is not None:
            self._credentials = Credentials(
                settings.offload_access_key_id, secret.get_secret_value()
            )
        else:
            self._credentials = botocore.session.Session().get_credentials()
        self.available = self._credentials is not None

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
        path = f"/{urllib.parse.quote(key, safe='/~')}" if key else ""
        url = f"{self._base}{path}?{urllib.parse.urlencode(query, quote_via=urllib.parse.quote)}"
        headers = await asyncio.to_thread(self.signed_headers, method, url)
        try:
            async with (
                aiohttp.ClientSession() as session,
                # Sent as signed: aiohttp must not encode the query again.
                session.request(method, yarl.URL(url, encoded=True), headers=headers) as reply,
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

    def signed_headers(self, method: str, url: str) -> dict[str, str]:
        """Blocking (a role's credentials may be refreshed): the headers of the request,
        signed with AWS Signature V4 by botocore."""
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        assert self._credentials is not None  # else not available: never called
        request = AWSRequest(method=method, url=url)
        frozen = self._credentials.get_frozen_credentials()
        S3SigV4Auth(frozen, "s3", self._region).add_auth(request)
        return dict(request.headers.items())
