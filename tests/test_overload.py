"""Overload with the gateway's admission limit set: the load generator's overload scenario
(``bench/overload.py`` measures it on the real stack) against the real gateway over fake
workers. Requests beyond ``--max-in-flight`` are refused at once (429 with ``Retry-After``, before
any admitted stream ends: nothing queues), admitted ones complete, nothing times out or fails
otherwise, and the load generator reports the refusals as such."""

from __future__ import annotations

import math

import aiohttp

from services.loadgen.client import ClientOptions, StreamingClient
from services.loadgen.metrics import summarize
from services.loadgen.results import Level
from services.loadgen.runner import run_level
from services.loadgen.target import Target
from services.loadgen.workload import RequestSpec
from tests.gateway_fakes import MODEL, StackFactory

LIMIT = 3
REQUESTS = 12


async def test_beyond_the_admission_limit_requests_get_429_at_once(make_stack: StackFactory) -> None:
    stack = await make_stack(max_in_flight=LIMIT)
    for decode in stack.decodes:
        decode.token_delay = 0.1  # each admitted stream lasts about a second
    specs = [RequestSpec(10, 2, messages=({"role": "user", "content": f"hi {i}"},))
             for i in range(REQUESTS)]  # fmt: skip
    async with aiohttp.ClientSession() as session:
        client = StreamingClient(session, Target("tandem", stack.url + "/v1", MODEL),
                                 ClientOptions(timeout_s=30), lambda text: len(text))  # fmt: skip
        duration, records = await run_level(client.send, specs, Level("rate", math.inf),
                                            progress=False)  # fmt: skip
    summary = summarize(records, duration)
    admitted = [r for r in records if r.ok]
    rejected = [r for r in records if r.error_kind == "rejected"]
    assert len(admitted) >= LIMIT and len(admitted) + len(rejected) == REQUESTS, records
    assert summary.errors_by_kind == {"rejected": len(rejected)}  # no timeout, no 5xx
    assert len(rejected) >= REQUESTS - 2 * LIMIT  # a burst at once: most are refused
    assert summary.rejected == len(rejected) and summary.rejected_without_retry_after == 0
    assert all(r.retry_after_s is not None and r.retry_after_s > 0 for r in rejected)
    first_done = min(r.sent_s + (r.e2e_s or 0) for r in admitted)
    # Refused at once: every 429 arrived before the first admitted stream was over.
    assert all(r.sent_s + (r.e2e_s or 0) < first_done for r in rejected)
    assert all(r.output_tokens == 10 for r in admitted)
