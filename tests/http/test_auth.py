"""The admin token guards every state change under /api/v1/; the write token guards adds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from node.http.app import build_app
from tests.harness.settings import make_settings

TOKEN = "s3cr3t-admin"


@pytest.fixture
async def guarded(tmp_path: Path, aiohttp_client: Any) -> Any:
    return await aiohttp_client(build_app(make_settings(tmp_path / "d", admin_token=TOKEN)))


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("post", "/api/v1/ledgers"),
        ("put", "/api/v1/ledgers/5"),
        ("delete", "/api/v1/ledgers/5"),
        ("post", "/api/v1/ledgers/5/entries"),
        ("put", "/api/v1/ledgers/5/entries/0"),
        ("post", "/api/v1/ledgers/5/fence"),
        ("put", "/api/v1/bookie/state/readonly"),
    ],
)
async def test_state_changes_need_the_bearer_token(guarded: Any, method: str, path: str) -> None:
    r = await getattr(guarded, method)(path)
    assert r.status == 401 and (await r.json())["code"] == "unauthorized"
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    r = await getattr(guarded, method)(path, headers={"Authorization": "Bearer wrong"})
    assert r.status == 403 and (await r.json())["code"] == "forbidden"
    r = await getattr(guarded, method)(path, headers={"Authorization": f"Basic {TOKEN}"})
    assert r.status == 401


async def test_the_right_token_passes_and_reads_need_none(guarded: Any) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = await guarded.put("/api/v1/ledgers/5", headers=auth)
    assert r.status == 201
    r = await guarded.put(
        "/api/v1/ledgers/5/entries/0",
        data=b"x",
        headers={**auth, "Content-Type": "application/octet-stream"},
    )
    assert r.status == 201
    assert (await guarded.get("/api/v1/ledgers/5/entries/0")).status == 200
    assert (await guarded.get("/api/v1/bookie/state")).status == 200
    config = await (await guarded.get("/api/v1/config/server_config", headers=auth)).json()
    assert config["admin_token"] == "******"  # never echoed


async def test_the_settings_need_the_token_and_show_no_credential(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    """They name host paths, the object store's endpoint and bucket: with a token set, only
    its holders read them; nobody reads a credential."""
    settings = make_settings(
        tmp_path / "d",
        admin_token=TOKEN,
        offload_access_key_id="AKIAEXAMPLEKEYID",
        offload_secret_access_key="wJalrXUtnFEMIsecret",
        offload_endpoint="http://minio-user:minio-password@minio:9000",
    )
    client = await aiohttp_client(build_app(settings))
    path = "/api/v1/config/server_config"
    r = await client.get(path)
    assert r.status == 401 and (await r.json())["code"] == "unauthorized"
    r = await client.get(path, headers={"Authorization": "Bearer wrong"})
    assert r.status == 403
    r = await client.get(path, headers={"Authorization": f"Bearer {TOKEN}"})
    text = await r.text()
    for secret in (
        TOKEN,
        "AKIAEXAMPLEKEYID",
        "wJalrXUtnFEMIsecret",
        "minio-user",
        "minio-password",
    ):
        assert secret not in text
    config = await r.json()
    assert config["offload_access_key_id"] == config["offload_secret_access_key"] == "******"
    assert config["offload_endpoint"] == "http://******@minio:9000"
    assert config["data_dir"] == str(tmp_path / "d")  # what is not a credential is shown


async def test_loopback_default_needs_no_token(client: Any) -> None:
    assert (await client.post("/api/v1/ledgers")).status == 201
