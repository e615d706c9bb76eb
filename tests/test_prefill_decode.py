"""Prefill and decode workers as real gRPC servers on 127.0.0.1 (both in this process), with the
KV travelling over ``Decode.TransferKV``: parity with the in-process engine, the KV channel's
advertisement, batching, the decode seat limit and logprobs — each over both transports
(``transport``: the payload in the gRPC chunks, or over a Gloo pair group with the control on
gRPC). Every cleanup and failure path is in ``test_prefill_decode_failures.py``; the pair
itself in ``prefill_decode_cluster.py``."""

from __future__ import annotations

import asyncio
import time

import grpc
import grpc.aio
import pytest

from services.common.cert_authority import issue
from services.common.grpc_channel import open_channel
from services.common.internal_tls import InternalTls
from services.common.pb import decode_pb2, decode_pb2_grpc
from services.common.sampling_params import SamplingParams
from services.engine.core.loaders import LoadedModel
from tests.tls_identities import session_ca, tls_for
from tests.prefill_decode_cluster import (  # noqa: F401 - model and transport are fixtures
    GREEDY, cluster, model, prompt_of, reference, tokens_of, transport,
)


async def test_prefill_to_decode_matches_the_engine_and_frees_everything(
    model: LoadedModel, transport: str
) -> None:
    prompt = prompt_of(40)
    expected = reference(model, [prompt], GREEDY)[0]
    async with cluster(model, transport=transport) as c:
        pre, responses = await c.run("one", prompt)
        assert tokens_of(responses) == expected
        assert pre.first_token_id == expected[0]
        assert responses[0].token_ids[0] == pre.first_token_id
        assert responses[-1].finish_reason == "length"
        assert responses[-1].completion_tokens == GREEDY.max_tokens
        assert all(not r.finish_reason for r in responses[:-1])
        block_bytes = c.prefill_handle.engine_loop.engine.layout.block_bytes
        assert (pre.num_prompt_tokens, pre.num_blocks, pre.kv_bytes) == (40, 3, 3 * block_bytes)
        assert pre.num_cached_tokens == 0 and pre.transfer_seconds > 0 and pre.prefill_seconds > 0
        await c.wait_idle()
        # The prefill worker's prefix cache serves the two full blocks the second time.
        again, responses = await c.run("two", prompt)
        assert again.num_cached_tokens == 32
        assert tokens_of(responses) == expected
        assert [r.num_cached_tokens for r in responses] == [32] * len(responses)  # decode knows too
        await c.wait_idle()
        pre_stats, dec_stats = await c.stats()
        assert (pre_stats.role, dec_stats.role) == ("prefill", "decode")
        assert dec_stats.worker_id == "decode-t" and dec_stats.address == c.decode_handle.address
        assert dec_stats.kv_blocks_total == 64 and dec_stats.block_size == 16
        metrics = c.prefill_handle.metrics
        assert metrics.kv_transfer_bytes._value.get() == 2 * pre.kv_bytes  # type: ignore[attr-defined]
        assert metrics.kv_transfer_seconds._sum.get() > 0  # type: ignore[attr-defined]
        if transport == "distributed":  # both payloads went over one pair group, both ways seen
            sent, received = c.prefill_group(), c.decode_group()
            assert sent is not None and received is not None and sent.key == received.key
            assert sent.num_bytes == received.num_bytes == 2 * pre.kv_bytes


@pytest.mark.parametrize("prefill_side, decode_side", [("distributed", "grpc"),
                                                      ("grpc", "distributed")])
async def test_the_channel_needs_both_ends_else_the_payload_stays_on_grpc(
    model: LoadedModel, prefill_side: str, decode_side: str
) -> None:
    prompt = prompt_of(40)
    expected = reference(model, [prompt], GREEDY)[0]
    async with cluster(model, transport=prefill_side, decode_transport=decode_side) as c:
        _, responses = await c.run("mixed", prompt)
        assert tokens_of(responses) == expected
        assert c.prefill_group() is None and c.decode_group() is None  # never set up
        await c.wait_idle()


async def test_the_channel_store_answers_only_the_prefill_worker_it_was_advertised_to(
    model: LoadedModel,
) -> None:
    """The pair's rendezvous store is ``Decode.KVStore`` on the decode worker's mTLS port: a
    client without a certificate, a gateway's (the wrong role) and another prefill worker's
    (not the peer the group was advertised to) cannot read or write the live group's keys, and
    the pair goes on using its group."""
    async with cluster(model, transport="distributed") as c:
        await c.run("before", prompt_of(40))
        group = c.decode_group()
        assert group is not None
        address = c.decode_handle.address
        probe = decode_pb2.KVStoreRequest(group=group.key, op=decode_pb2.KVStoreRequest.GET,
                                          keys=[f"{group.key}/0"], timeout_seconds=0.1)  # fmt: skip
        other = issue(session_ca(), "prefill")
        other_prefill = InternalTls.from_pem(other.cert_pem, other.key_pem, session_ca().cert_pem)
        clients = {
            "no certificate": (grpc.aio.insecure_channel(address), grpc.StatusCode.UNAVAILABLE),
            "a gateway": (open_channel(address, tls=tls_for("gateway"), server_role="decode"),
                          grpc.StatusCode.PERMISSION_DENIED),
            "another prefill worker": (open_channel(address, tls=other_prefill,
                                                    server_role="decode"),
                                       grpc.StatusCode.NOT_FOUND),
        }  # fmt: skip
        for who, (channel, expected) in clients.items():
            async with channel:
                for request in (probe, decode_pb2.KVStoreRequest(
                        group=group.key, op=decode_pb2.KVStoreRequest.SET,
                        keys=[f"{group.key}/0"], value=b"attacker:1")):  # fmt: skip
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await decode_pb2_grpc.DecodeStub(channel).KVStore(request, timeout=5)
                    assert refused.value.code() == expected, who
        _, responses = await c.run("after", prompt_of(40))
        assert responses[-1].finish_reason == "length"
        assert c.decode_group() is group and not group.broken and c.groups_built() == (1, 1)
        await c.wait_idle()


async def test_concurrent_requests_are_batched_in_decode(
    model: LoadedModel, transport: str
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [prompt_of(20 + 3 * i, offset=i) for i in range(4)]
    expected = reference(model, prompts, params)
    async with cluster(model, transport=transport) as c:
        results = await asyncio.gather(*(c.run(f"b{i}", p, params) for i, p in enumerate(prompts)))
        assert [tokens_of(responses) for _, responses in results] == expected
        assert c.decode_handle.engine_loop.stats.max_batch_size > 1
        await c.wait_idle()


async def test_decode_seat_limit_queues_hand_offs(model: LoadedModel) -> None:
    """--max-num-seqs 1: hand-offs wait for the seat, keep their KV, and give the same tokens;
    a client that gives up while its request waits frees that request's blocks."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [prompt_of(20 + 3 * i, offset=i) for i in range(3)]
    expected = reference(model, prompts, params)
    async with cluster(model, decode_max_seqs=1) as c:
        results = await asyncio.gather(*(c.run(f"q{i}", p, params) for i, p in enumerate(prompts)))
        assert [tokens_of(responses) for _, responses in results] == expected
        assert c.decode_handle.engine_loop.stats.max_batch_size == 1
        await c.wait_idle()
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        seated = c.generate("seated")
        await c.prefill("seated", prompt_of(30), long)
        await seated.read()
        queued = c.generate("queued")
        await c.prefill("queued", prompt_of(25, offset=7), long)
        deadline = time.monotonic() + 10
        while (dec := (await c.stats())[1]).num_waiting < 1:  # until Generate hands it over
            assert time.monotonic() < deadline, dec
            await asyncio.sleep(0.02)
        assert dec.num_running == 1
        queued.cancel()
        seated.cancel()
        await c.wait_idle()


async def test_logprobs_travel_with_the_first_token(model: LoadedModel, transport: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    async with cluster(model, transport=transport) as c:
        pre, responses = await c.run("lp", prompt_of(25), params)
        assert pre.HasField("first_logprob") and pre.first_logprob.token_id == pre.first_token_id
        logprobs = [lp for r in responses for lp in r.logprobs]
        assert [lp.token_id for lp in logprobs] == tokens_of(responses)
        assert logprobs[0] == pre.first_logprob
        assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in logprobs)
        assert logprobs[1].top[0].token_id == logprobs[1].token_id  # greedy picks the top one
        await c.wait_idle()
