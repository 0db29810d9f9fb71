"""Raw HTTP/1.1 over a loopback socket, for tests where a client library would hide what
matters (pipelining, partial heads and bodies, the order of answers, which server answered,
when the server closes)."""

from __future__ import annotations

import asyncio
import json
from typing import Any


class Conn:
    """A raw connection that reads HTTP/1.1 answers one at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self) -> tuple[int, dict[str, str], Any]:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        ctype = headers.get("content-type", "")
        return status, headers, json.loads(body) if ctype.startswith("application/json") else body

    async def closed_by_server(self, within_s: float = 10) -> bool:
        try:
            return await asyncio.wait_for(self.reader.read(1), within_s) == b""
        except TimeoutError:
            return False
