"""Incomplete multipart uploads: the AWS Signature V4 of the two S3 calls is botocore's to
the byte; uploads no attempt completed are listed by status and aborted on request."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from node.offload.multipart import S3Uploads
from tests.harness.moto import KEY_ID, REGION, SECRET, s3_client
from tests.harness.settings import make_settings
from tests.offload.test_offload import closed_ledger, new_client, objects, payloads, run


def test_the_credentials_come_from_the_settings_else_from_awss_chain(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Static keys of the settings first; without them botocore's chain (here the AWS_*
    variables; a web identity or the instance's role where there is one); with nothing, the
    uploads cannot be listed (and no request is made)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    base = {"offload_store": "s3", "offload_bucket": "b", "offload_region": REGION}
    url = "http://127.0.0.1:9/b?uploads=&prefix=node-0%2F12%2F"

    def key_id(uploads: S3Uploads) -> str:
        authorization = uploads.signed_headers("GET", url)["Authorization"]
        return authorization.split("Credential=")[1].split("/")[0]

    assert not S3Uploads(make_settings(tmp_path / "d", **base)).available
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "FROM-THE-CHAIN")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    assert key_id(S3Uploads(make_settings(tmp_path / "d", **base))) == "FROM-THE-CHAIN"
    configured = make_settings(
        tmp_path / "d", **base, offload_access_key_id=KEY_ID, offload_secret_access_key=SECRET
    )
    assert key_id(S3Uploads(configured)) == KEY_ID


async def test_incomplete_uploads_are_listed_and_aborted_on_request(
    aiohttp_client: Any, tmp_path: Path, store_settings: dict[str, Any]
) -> None:
    data = tmp_path / "data"
    client = await new_client(aiohttp_client, data, store_settings)
    lid = await closed_ledger(client, payloads(20, seed=7))
    assert (await run(client, {"ledgers": [lid]}))["offloaded"] == [lid]
    known = await objects(client)
    stray = "4242/0123abcd.data"
    if store_settings["offload_store"] == "s3":
        s3 = s3_client(store_settings["offload_endpoint"])
        bucket = store_settings["offload_bucket"]

        def begin() -> str:
            upload = s3.create_multipart_upload(Bucket=bucket, Key=f"node-0/{stray}")
            s3.upload_part(
                Bucket=bucket,
                Key=f"node-0/{stray}",
                UploadId=upload["UploadId"],
                PartNumber=1,
                Body=b"x" * (5 << 20),
            )
            return str(upload["UploadId"])

        upload_id = await asyncio.to_thread(begin)
    else:
        upload_id = "3"
        staging = data / "offload" / f"{stray}#{upload_id}"
        await asyncio.to_thread(staging.parent.mkdir)
        await asyncio.to_thread(staging.write_bytes, b"x" * 1024)

    status = await (await client.get("/api/v1/offload/status")).json()
    assert status["incompleteUploads"] == [{"key": stray, "uploadId": upload_id}]
    assert status["unknownObjects"] == []  # not an object: a listing does not show it
    await run(client, {})
    r = await client.delete("/api/v1/offload/unknown-objects")
    assert r.status == 200
    assert await r.json() == {
        "removed": [],
        "abortedUploads": [{"key": stray, "uploadId": upload_id}],
    }
    status = await (await client.get("/api/v1/offload/status")).json()
    assert status["incompleteUploads"] == []
    assert await objects(client) == known
