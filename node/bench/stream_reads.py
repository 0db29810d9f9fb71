"""The load process of ``bench stream --replicated``'s catch-up rows: one reader takes a whole
stream of ``indexed_payload`` entries from its start, page by page, as a consumer that is
far behind does, and checks every entry against the one written there.

- plain reads: ``GET /api/v1/streams/{name}/entries?limit=PAGE[&from=...]``, each from the
  previous reply's ``X-Next-Position`` (a reply cut by ``max_read_reply_bytes`` is followed
  the same way);
- a cursor's reads: ``GET .../cursors/{cursor}/entries?limit=PAGE``, then an ack of the last
  entry before the next read (the cursor is created at ``earliest`` first).

It reads until it has the entries the stream was filled with (or a read comes back empty:
then it reports the ones it got, and the bench fails). The CPU of the serving processes is
taken here, around the read loop only, so that the process's start does not count.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from node.bench.server import cpu_by_pid, misread
from node.wire import decode_stream_frames

PLAIN, CURSOR = "plain", "cursor"
CURSOR_NAME = "catch-up"
ERROR_BODY_CHARS = 300  # of a refusal's body, in the error the bench prints


class ReadRefused(RuntimeError):
    """A read the node answered with an error status: the bench stops there."""


async def catch_up(
    url: str, stream: str, mode: str, entries: int, page: int, pids: list[int]
) -> dict[str, Any]:
    import aiohttp  # the load process only

    base = f"{url}/api/v1/streams/{stream}"
    pages: list[float] = []
    got = wrong = 0
    position = None
    async with aiohttp.ClientSession() as session:

        async def checked(response: aiohttp.ClientResponse) -> bytes:
            body = await response.read()
            if response.status not in (200, 201):
                detail = body[:ERROR_BODY_CHARS].decode(errors="replace")
                raise ReadRefused(f"{response.method} {response.url}: {response.status} {detail}")
            return body

        if mode == CURSOR:
            async with session.put(
                f"{base}/cursors/{CURSOR_NAME}", json={"start": "earliest"}
            ) as response:
                await checked(response)
        cpu_before = cpu_by_pid(pids)
        started = time.perf_counter()
        while got < entries:
            page_started = time.perf_counter()
            if mode == CURSOR:
                read_url = f"{base}/cursors/{CURSOR_NAME}/entries?limit={page}"
            else:
                read_url = f"{base}/entries?limit={page}" + (
                    f"&from={position}" if position else ""
                )
            async with session.get(read_url) as response:
                frames = decode_stream_frames(await checked(response))
                position = response.headers.get("X-Next-Position", position)
            if not frames:
                break  # the stream ends short of what was written: reported as such
            wrong += misread(got, (payload for _, payload in frames))
            got += len(frames)
            if mode == CURSOR:
                last = str(frames[-1][0])
                async with session.post(
                    f"{base}/cursors/{CURSOR_NAME}/ack", json={"position": last}
                ) as response:
                    await checked(response)
            pages.append(time.perf_counter() - page_started)
        seconds = time.perf_counter() - started
        cpu_after = cpu_by_pid(pids)
    return {
        "entries": got,
        "requests": len(pages),
        "seconds": seconds,
        "pages": pages,
        "misread": wrong,
        "cpu": {str(pid): cpu_after[pid] - cpu_before[pid] for pid in pids},
    }


def load_main(argv: list[str]) -> None:
    from node.runtime import run

    url, stream, mode, entries, page, pids = argv
    serving = [int(pid) for pid in pids.split(",")]
    json.dump(run(catch_up(url, stream, mode, int(entries), int(page), serving)), sys.stdout)


if __name__ == "__main__":
    load_main(sys.argv[1:])
