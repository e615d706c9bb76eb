"""``GET /``: the chat playground, one static HTML page (``static/playground.html``).

The page carries its own CSS and JavaScript (no build step, nothing from a CDN) and talks only to
this gateway's API: ``GET /v1/models`` and ``POST /v1/chat/completions`` streamed over SSE, with
the API key typed into the page sent as ``Authorization: Bearer``. The page itself is served
without authentication, like ``/health``: it holds no data, only the client.

The response's Content-Security-Policy allows exactly the page's own inline ``<script>`` and
``<style>`` (by SHA-256) and requests to this origin, so the page cannot load or send anything
elsewhere even if a reply contained markup (it is inserted as text anyway).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from dataclasses import dataclass
from importlib import resources

from aiohttp import web

PAGE = "static/playground.html"
_INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class _Page:
    body: bytes
    headers: dict[str, str]


@functools.cache
def _page() -> _Page:
    """The page and its headers, read from the package once, on first use."""
    text = (resources.files("services.gateway") / PAGE).read_text(encoding="utf-8")
    hashes: dict[str, list[str]] = {"script": [], "style": []}
    for tag, content in _INLINE.findall(text):
        digest = base64.b64encode(hashlib.sha256(content.encode("utf-8")).digest()).decode()
        hashes[tag].append(f"'sha256-{digest}'")
    policy = "; ".join([
        "default-src 'none'",
        "script-src " + " ".join(hashes["script"]),
        "style-src " + " ".join(hashes["style"]),
        "connect-src 'self'",
        "img-src 'self' data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])  # fmt: skip
    headers = {
        "Content-Type": "text/html; charset=utf-8",
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }
    return _Page(body=text.encode("utf-8"), headers=headers)


async def playground(_: web.Request) -> web.Response:
    """``GET /``: the playground page (no authentication; the page asks for a key itself)."""
    page = _page()
    return web.Response(body=page.body, headers=page.headers)
