"""Incomplete multipart uploads: the AWS Signature V4 of the two S3 calls is botocore's to
the byte; uploads no attempt completed are listed by status and aborted on request."""

from __future__ import annotations

import asyncio
import datetime as dt
import urllib.parse
from pathlib import Path
from typing import Any

import boto3
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials as BotoCredentials

from node.offload.multipart import Credentials, sign
from tests.offload.conftest import KEY_ID, REGION, SECRET
from tests.offload.test_offload import closed_ledger, new_client, objects, payloads, run


def test_the_signature_is_botocores() -> None:
    for method, url, query, token in [
        ("GET", "http://127.0.0.1:9000/my-bucket", {"uploads": "", "prefix": "node-0/12/"}, None),
        (
            "DELETE",
            "https://my-bucket.s3.eu-west-1.amazonaws.com/node-0/12/0a1b.data",
            {"uploadId": "Xy+z/w=="},
            "session-token",
        ),
    ]:
        request = AWSRequest(method=method, url=f"{url}?{urllib.parse.urlencode(query)}")
        S3SigV4Auth(BotoCredentials("AKID", "s3cr3t", token), "s3", "eu-west-1").add_auth(request)
        when = dt.datetime.strptime(request.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ")
        ours = sign(
            method, url, query, "eu-west-1", Credentials("AKID", "s3cr3t", token),
            when.replace(tzinfo=dt.UTC),
        )  # fmt: skip
        assert ours["Authorization"] == request.headers["Authorization"]


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
        s3 = boto3.client(
            "s3",
            endpoint_url=store_settings["offload_endpoint"],
            region_name=REGION,
            aws_access_key_id=KEY_ID,
            aws_secret_access_key=SECRET,
        )
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
