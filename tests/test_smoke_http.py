from typing import Any


async def test_create_add_read(client: Any) -> None:
    r = await client.post("/api/v1/ledgers")
    assert r.status == 201
    lid = (await r.json())["ledgerId"]
    r = await client.put(f"/api/v1/ledgers/{lid}/entries/0", data=b"abc",
                         headers={"Content-Type": "application/octet-stream"})
    assert r.status == 201, await r.text()
    r = await client.get(f"/api/v1/ledgers/{lid}/entries/0")
    assert await r.read() == b"abc"
