"""The prefix-cache feed that KV-aware routers follow: the block manager's events, their
coalescing per subscriber, the ``PrefixCache.Watch`` stream of a real worker (snapshot, changes,
resubscribe), and the gateway's :class:`PrefixIndex` fed from it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import grpc.aio
import pytest

from services.common.errors import ResourceExhaustedError, UnavailableError
from services.common.grpc_channel import open_channel
from services.common.pb import decode_pb2, decode_pb2_grpc, prefix_cache_pb2, prefix_cache_pb2_grpc
from services.common.prefix_hash import block_hashes, prefix_root, routing_key, routing_keys
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_to_proto
from services.decode.server import start_decode_worker
from services.engine.core.block_manager import BlockManager
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.runtime.prefix_cache_feed import Subscription
from services.engine.runtime.worker_options import WorkerOptions
from services.gateway.prefix_index import PrefixIndex
from tests.tls_identities import tls_for

BS = 4


def test_block_manager_reports_stored_evicted_and_cleared_keys() -> None:
    events: list[tuple[str, list[bytes]]] = []
    bm = BlockManager(3, BS, on_event=lambda kind, keys: events.append((kind, list(keys))))
    prompt = list(range(10, 19))  # 2 full blocks + 1 token
    alloc = bm.allocate_prompt(prompt)
    bm.cache_full_blocks(alloc.block_ids, prompt)
    assert events == [("stored", block_hashes(prompt, BS))]
    bm.cache_full_blocks(alloc.block_ids, prompt)  # idempotent: nothing new
    assert len(events) == 1
    bm.free(alloc.block_ids)
    events.clear()
    bm.allocate(3)  # 1 free block, then both cached blocks are evicted (tail first)
    assert events == [("removed", [block_hashes(prompt, BS)[1]]),
                      ("removed", [block_hashes(prompt, BS)[0]])]
    assert bm.cached_digests() == []
    bm.reset_prefix_cache()
    assert events[-1] == ("cleared", [])


async def test_a_subscription_coalesces_changes_and_snapshots_after_a_clear() -> None:
    sub = Subscription(asyncio.get_running_loop(), max_backlog=100)
    sub.push("stored", [1, 2])
    first = await sub.next()
    assert first.snapshot and sorted(first.stored) == [1, 2] and first.removed == ()
    sub.push("stored", [3])
    sub.push("removed", [1, 3])  # stored then evicted before anyone read: evicted
    sub.push("stored", [4])
    change = await sub.next()
    assert not change.snapshot
    assert change.stored == (4,) and sorted(change.removed) == [1, 3]
    sub.push("stored", [5])
    sub.push("cleared", [])
    sub.push("stored", [6])
    after_clear = await sub.next()
    assert after_clear.snapshot and after_clear.stored == (6,)
    waiter = asyncio.create_task(sub.next())
    await asyncio.sleep(0.01)
    assert not waiter.done()  # nothing pending: it waits
    sub.push("stored", [7])
    assert (await asyncio.wait_for(waiter, 1)).stored == (7,)


async def test_a_subscriber_too_far_behind_is_cut_off_and_a_closed_feed_ends_streams() -> None:
    loop = asyncio.get_running_loop()
    slow = Subscription(loop, max_backlog=3)
    slow.push("stored", range(4))
    with pytest.raises(ResourceExhaustedError):
        await slow.next()
    closed = Subscription(loop, max_backlog=10)
    await closed.next()  # the (empty) snapshot
    closed.end(UnavailableError("stopping"))
    with pytest.raises(UnavailableError):
        await closed.next()


def test_the_prefix_index_counts_leading_cached_blocks() -> None:
    index = PrefixIndex()
    prompt = list(range(100, 120))  # 5 blocks of 4
    keys = routing_keys(prompt, BS)
    index.apply("w1", prefix_cache_pb2.PrefixCacheUpdate(snapshot=True, stored=keys[:3],
                                                         block_size=BS))
    assert index.overlap_blocks("w1", keys) == 3 and index.block_size("w1") == BS
    index.apply("w1", prefix_cache_pb2.PrefixCacheUpdate(stored=keys[3:], removed=[keys[1]]))
    assert index.overlap_blocks("w1", keys) == 1  # a key names a prefix: a hole ends the match
    assert index.overlap_blocks("w2", keys) == 0 and index.block_size("w2") is None
    index.apply("w1", prefix_cache_pb2.PrefixCacheUpdate(snapshot=True, stored=[]))
    assert index.overlap_blocks("w1", keys) == 0 and index.num_keys("w1") == 0
    index.forget("w1")
    assert index.block_size("w1") is None


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir))


async def next_update(call: grpc.aio.UnaryStreamCall, timeout: float = 10.0
                      ) -> prefix_cache_pb2.PrefixCacheUpdate:
    update = await asyncio.wait_for(call.read(), timeout)
    assert update is not grpc.aio.EOF
    return update


async def collect_until(call: grpc.aio.UnaryStreamCall, keys: set[int],
                        done: Callable[[set[int]], bool]) -> set[int]:
    deadline = time.monotonic() + 10
    while not done(keys):
        assert time.monotonic() < deadline, f"feed stalled at {len(keys)} keys"
        update = await next_update(call)
        if update.snapshot:
            keys = set()
        keys |= set(update.stored)
        keys -= set(update.removed)
    return keys


async def test_a_worker_streams_its_prefix_cache_snapshot_then_changes(model: LoadedModel) -> None:
    handle = await start_decode_worker(
        WorkerOptions(tls=tls_for("decode"), host="127.0.0.1", port=0, num_blocks=12, block_size=BS,
                      worker_id="decode-feed"), loaded=model)  # fmt: skip
    channel = open_channel(handle.address, tls=tls_for("gateway"))
    try:
        watch = prefix_cache_pb2_grpc.PrefixCacheStub(channel).Watch(
            prefix_cache_pb2.WatchPrefixCacheRequest())
        first = await next_update(watch)
        assert first.snapshot and list(first.stored) == [] and first.sequence == 0
        assert first.block_size == BS and first.worker_id == "decode-feed"

        prompt = [(7 * i + 5) % 200 + 3 for i in range(18)]
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        decode = decode_pb2_grpc.DecodeStub(channel)
        call = decode.Generate(decode_pb2.GenerateRequest(
            request_id="feed-1", prompt_token_ids=prompt,
            params=sampling_params_to_proto(params)))  # fmt: skip
        replies = [r async for r in call]
        output = [t for r in replies for t in r.token_ids]
        # Prompt + output tokens whose KV was written (the last sampled token's was not).
        written = (prompt + output)[: len(prompt) + len(output) - 1]
        root = prefix_root(tls_for("decode").prefix_salt)  # keys are salted per deployment
        expected = set(routing_keys(written, BS, root))
        assert not expected & set(routing_keys(written, BS))  # never the raw prompt hashes
        keys = await collect_until(watch, set(), lambda k: expected <= k)
        assert keys == expected

        # A second subscriber (or the first, reconnecting) starts from an equal snapshot.
        again = prefix_cache_pb2_grpc.PrefixCacheStub(channel).Watch(
            prefix_cache_pb2.WatchPrefixCacheRequest())
        snapshot = await next_update(again)
        assert snapshot.snapshot and set(snapshot.stored) == expected
        again.cancel()

        # A longer prompt needs 11 of the 12 blocks: 7 free ones and 4 of the 5 cached ones,
        # evicted tail first, so only the first block of the old prefix stays. The feed says so.
        other = [(11 * i + 1) % 200 + 3 for i in range(40)]
        call = decode.Generate(decode_pb2.GenerateRequest(
            request_id="feed-2", prompt_token_ids=other,
            params=sampling_params_to_proto(params)))  # fmt: skip
        _ = [r async for r in call]
        keys = await collect_until(watch, keys, lambda k: len(expected & k) == 1)
        assert expected & keys == {routing_key(block_hashes(prompt, BS, root)[0])}
        assert routing_key(block_hashes(other, BS, root)[0]) in keys
        watch.cancel()
    finally:
        await channel.close()
        started = time.monotonic()
        await handle.stop(5.0)
    assert time.monotonic() - started < 4.0  # open watch streams do not hold up the stop


async def test_a_stopping_worker_ends_its_watch_streams(model: LoadedModel) -> None:
    handle = await start_decode_worker(
        WorkerOptions(tls=tls_for("decode"),
                      host="127.0.0.1", port=0, num_blocks=8, worker_id="decode-stop"),
        loaded=model)  # fmt: skip
    channel = open_channel(handle.address, tls=tls_for("gateway"))
    try:
        watch = prefix_cache_pb2_grpc.PrefixCacheStub(channel).Watch(
            prefix_cache_pb2.WatchPrefixCacheRequest())
        await next_update(watch)
        stop = asyncio.create_task(handle.stop(10.0))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(watch.read(), 5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await asyncio.wait_for(stop, 5)
    finally:
        await channel.close()
        await handle.stop(0)
