"""A server under test: its name, its OpenAI base URL, the model to ask for, and how to ask.

``--base-url`` names one server; ``--compare NAME=URL[@MODEL] ...`` names several, run one after
another in one invocation. A URL without a path gets ``/v1`` (``http://host:8000`` is
``http://host:8000/v1``); a trailing slash is dropped. Without a model, the first id of
``GET {base}/models`` is used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from services.common.errors import InvalidArgumentError, UnavailableError

logger = logging.getLogger(__name__)

ENDPOINT_PATHS = {"chat": "/chat/completions", "completions": "/completions"}


@dataclass(frozen=True, slots=True)
class Target:
    """One server. ``model`` is None until discovered."""

    name: str
    base_url: str
    model: str | None = None

    def url(self, endpoint: str) -> str:
        return self.base_url + ENDPOINT_PATHS[endpoint]


def normalize_base_url(url: str) -> str:
    """``http://host:port[/path]`` with ``/v1`` when there is no path, without a trailing slash."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidArgumentError(f"not an http(s) URL: {url!r}")
    url = url.rstrip("/")
    return url + "/v1" if parts.path in ("", "/") else url


def parse_compare(items: list[str]) -> list[Target]:
    """``NAME=URL`` or ``NAME=URL@MODEL`` items (the model after the last ``@``)."""
    targets = []
    for item in items:
        name, sep, rest = item.partition("=")
        if not sep or not name or not rest:
            raise InvalidArgumentError(f"--compare expects NAME=URL[@MODEL], got {item!r}")
        url, at, model = rest.rpartition("@") if "@" in rest else (rest, "", "")
        if at and not model:
            raise InvalidArgumentError(f"--compare {item!r}: empty model after '@'")
        targets.append(Target(name, normalize_base_url(url), model or None))
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"--compare names must differ: {names}")
    return targets


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def model_id(
    session: aiohttp.ClientSession, target: Target, api_key: str | None, timeout_s: float = 30.0
) -> str:
    """The first model id listed by ``GET {base}/models``; UnavailableError when there is none."""
    url = target.base_url + "/models"
    try:
        async with session.get(
            url, headers=auth_headers(api_key), timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            body = await response.text()
            if response.status != 200:
                raise UnavailableError(
                    f"GET {url} answered HTTP {response.status}: {body[:200]} (pass --model)"
                )
            data = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise UnavailableError(f"cannot list the models of {url}: {exc!r} (pass --model)") from exc
    models = data.get("data") if isinstance(data, dict) else None
    ids = [m.get("id") for m in models or [] if isinstance(m, dict)]
    if not ids or not isinstance(ids[0], str):
        raise UnavailableError(f"GET {url} lists no model (pass --model)")
    logger.info("%s serves model %s", target.name, ids[0])
    return ids[0]
