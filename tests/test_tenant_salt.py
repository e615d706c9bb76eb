"""Tenants never share prefix-cache blocks (``services/gateway/tenant_salt.py``): with API keys
on, a prompt cached for one key is a miss for another (``cached_tokens`` 0, so the side channel
tells nothing), whatever ``cache_salt`` the other sends, while one key's repeated prompt is a hit
and a client ``cache_salt`` narrows its own key's sharing. Real workers and gateway, the
official ``openai`` SDK."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from services.gateway.auth import ANONYMOUS, key_id
from services.gateway.tenant_salt import tenant_cache_salt
from tests.tiny_stack import API_KEY, TinyStack, tiny_stack

OTHER = "other-tenant-key"
# long enough for whole cached blocks, short enough to be prefilled by the decode worker
PROMPT = [(11 * i + 5) % 30000 + 1000 for i in range(36)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TinyStack]:
    async with tiny_stack(tmp_path_factory.mktemp("tenants"), more_keys=(OTHER,)) as started:
        yield started


async def cached(stack: TinyStack, key: str, **extra: Any) -> int:
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)
    reply = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                            temperature=0, extra_body=extra or None)  # fmt: skip
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


@pytest.mark.asyncio(loop_scope="module")
async def test_one_key_reuses_its_prefix_another_never_sees_it(stack: TinyStack) -> None:
    assert await cached(stack, API_KEY) == 0
    assert await cached(stack, API_KEY) > 0  # the same tenant: a hit
    assert await cached(stack, OTHER) == 0  # another tenant: a miss, nothing learned
    own = tenant_cache_salt(key_id(API_KEY), "")
    assert await cached(stack, OTHER, cache_salt=own) == 0  # naming the first's salt: no reach
    assert await cached(stack, OTHER) > 0  # its own copy now
    assert await cached(stack, API_KEY, cache_salt="narrow") == 0  # a client salt narrows
    assert await cached(stack, API_KEY, cache_salt="narrow") > 0
    await stack.wait_idle()


def test_salts_differ_per_key_and_client_salt_and_stay_short() -> None:
    a, b = key_id(API_KEY), key_id(OTHER)
    salts = {tenant_cache_salt(k, s) for k in (a, b) for s in ("", "x", "y")}
    assert len(salts) == 6 and all(len(s) <= 256 for s in salts)
    assert tenant_cache_salt(ANONYMOUS, "x") == "x"  # no keys: the client's salt, as sent
    assert tenant_cache_salt(a, "y" * 256) != tenant_cache_salt(a, "y" * 255)
