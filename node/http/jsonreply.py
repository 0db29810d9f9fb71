"""Every JSON reply's bytes, in one place: ``json.dumps``'s spacing and a final newline, so
that ``curl`` output ends its line before the shell's prompt and line-oriented tools read a
reply whole. The hot path's templates (adds, stream appends) end with the same LINE_END."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from node.wire import JSON_CONTENT_TYPE

LINE_END = b"\n"


def json_bytes(value: Any) -> bytes:
    return json.dumps(value).encode() + LINE_END


def json_response(
    value: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=json_bytes(value), status=status, headers=headers, content_type=JSON_CONTENT_TYPE
    )
