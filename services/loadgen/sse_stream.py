"""Server-sent events off an HTTP body, each with the time its last line arrived.

OpenAI-compatible servers stream ``data: {json}`` events separated by blank lines and end with
``data: [DONE]``. This reads the body line by line as it arrives, joins an event's ``data``
lines, skips comments (``: keep-alive``) and other fields, and stamps each event with
``time.perf_counter()`` when its last line came in, so the stamps are network arrival times, not
parse times. A final event not followed by a blank line is still delivered at the end.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp


async def sse_events(body: aiohttp.StreamReader) -> AsyncIterator[tuple[float, str]]:
    """``(arrival time, data)`` per event, in order."""
    data: list[str] = []
    stamp = 0.0
    async for raw in body:
        now = time.perf_counter()
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                yield stamp, "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
            stamp = now
    if data:
        yield stamp, "\n".join(data)
