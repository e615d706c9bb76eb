"""KV-aware routing (services/gateway/router.py): the cost ``overlap_weight * uncached blocks +
load_weight * load`` ranks workers; a prompt goes where its prefix is cached until that worker is
busy enough; weight 0 routes by load alone; the prefill decision uses the decode worker's
uncached part; and the gateway's index follows real workers' feeds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from services.common.errors import InvalidArgumentError
from services.common.pb import common_pb2, prefix_cache_pb2
from services.common.protocol import PROTOCOL_VERSION
from services.common.prefix_hash import routing_keys
from services.gateway.config import RoutingWeights
from services.gateway.router import PromptKeys, Router, WorkerState
from tests.tls_identities import tls_for

BS = 16


@dataclass
class Client:
    role: str
    address: str


def router_of(n: int, weights: RoutingWeights = RoutingWeights()) -> tuple[Router, list[WorkerState]]:
    router = Router([], [Client("decode", f"d{i}") for i in range(n)],  # type: ignore[misc]
                    weights=weights)  # fmt: skip
    workers = list(router.workers("decode"))
    for w in workers:
        w.healthy = True
        w.stats = common_pb2.WorkerStats(block_size=BS)
    return router, workers


def cache(router: Router, address: str, tokens: list[int]) -> None:
    router.prefix_index.apply(address, prefix_cache_pb2.PrefixCacheUpdate(
        snapshot=True, stored=routing_keys(tokens, BS), block_size=BS))  # fmt: skip


SYSTEM = list(range(1000, 1000 + 10 * BS))  # a 10-block system prompt


def test_a_cached_prefix_wins_over_an_idle_worker_until_its_worker_is_busy_enough() -> None:
    router, (d0, d1, d2) = router_of(3)
    for w in (d0, d1, d2):
        cache(router, w.address, [])
    cache(router, "d1", SYSTEM)
    prompt = PromptKeys(SYSTEM + [7, 8, 9])
    assert router.pick("decode", prompt) is d1
    assert router.cached_tokens(d1, prompt) == 10 * BS and router.cached_tokens(d0, prompt) == 0
    # 10 cached blocks are worth 10 / 4 = 2.5 requests of queue at the default weights.
    d1.in_flight = 2
    assert router.pick("decode", prompt) is d1
    d1.in_flight = 3
    assert router.pick("decode", prompt) in (d0, d2)
    # Its stats (other gateways' requests) count as load too.
    d1.in_flight = 0
    d1.stats = common_pb2.WorkerStats(block_size=BS, num_running=2, num_waiting=1)
    assert router.pick("decode", prompt) in (d0, d2)


def test_a_hole_in_the_chain_ends_the_overlap() -> None:
    router, (d0, d1) = router_of(2)
    keys = routing_keys(SYSTEM, BS)
    router.prefix_index.apply("d0", prefix_cache_pb2.PrefixCacheUpdate(
        snapshot=True, stored=keys[:2] + keys[3:], block_size=BS))  # fmt: skip
    cache(router, "d1", SYSTEM[: 4 * BS])
    prompt = PromptKeys(SYSTEM + [1])
    assert router.cached_tokens(d0, prompt) == 2 * BS
    assert router.pick("decode", prompt) is d1  # 4 leading blocks beat 2 (+ 7 unreachable)


def test_without_overlap_or_with_weight_zero_it_is_least_loaded_with_rotation() -> None:
    router, (d0, d1) = router_of(2)
    prompt = PromptKeys(SYSTEM)
    picks = {router.pick("decode", prompt).address for _ in range(4)}
    assert picks == {"d0", "d1"}  # equal workers share a burst
    d0.in_flight = 1
    assert router.pick("decode", prompt) is d1
    off, (e0, e1) = router_of(2, RoutingWeights(overlap_weight=0.0))
    cache(off, "d0", SYSTEM)
    e0.in_flight = 1
    assert off.pick("decode", PromptKeys(SYSTEM + [1])) is e1  # the cache is ignored
    assert off.ranked("decode", exclude={"d1"}) == [e0]


def test_routing_weights_are_validated() -> None:
    with pytest.raises(InvalidArgumentError):
        RoutingWeights(overlap_weight=-1).validate()
    with pytest.raises(InvalidArgumentError):
        RoutingWeights(load_weight=0).validate()
    assert not RoutingWeights(overlap_weight=0).kv_aware


async def test_the_router_follows_a_real_workers_feed(tiny_llama_dir) -> None:  # type: ignore[no-untyped-def]
    from services.common.grpc_channel import open_channel
    from services.common.pb import decode_pb2, decode_pb2_grpc
    from services.common.prefix_hash import prefix_root
    from services.common.sampling_params import SamplingParams
    from services.common.wire import sampling_params_to_proto
    from services.decode.server import start_decode_worker
    from services.engine.core.loaders import load_model
    from services.engine.runtime.worker_options import WorkerOptions
    from services.gateway.backend import Backend
    from services.gateway.config import GatewayConfig

    model = load_model(str(tiny_llama_dir))
    handles = [await start_decode_worker(
        WorkerOptions(tls=tls_for("decode"), host="127.0.0.1", port=0, num_blocks=32, block_size=4,
                      worker_id=f"decode-{i}"), loaded=model) for i in range(2)]  # fmt: skip
    config = GatewayConfig(tokenizer_addresses=("127.0.0.1:1",), prefill_addresses=(),
                           decode_addresses=tuple(h.address for h in handles),
                           tls=tls_for("gateway"))  # fmt: skip
    backend = Backend(config)
    router = Router(backend.prefill, backend.decode, interval_s=0.2)
    router.model_fingerprint = model.fingerprint  # what the tokenizer would report
    channel = open_channel(handles[1].address, tls=tls_for("gateway"))
    try:
        await router.start()
        prompt = [(3 * i + 1) % 200 + 3 for i in range(21)]
        salt = tls_for("gateway").prefix_salt  # the deployment's: the same CA as the workers'
        assert salt == tls_for("decode").prefix_salt != b""
        keys = PromptKeys(prompt, prefix_root(salt))
        params = sampling_params_to_proto(SamplingParams(temperature=0.0, max_tokens=2))
        call = decode_pb2_grpc.DecodeStub(channel).Generate(decode_pb2.GenerateRequest(
            request_id="r1", prompt_token_ids=prompt, params=params))  # fmt: skip
        _ = [m async for m in call]
        w0, w1 = router.workers("decode")
        for _ in range(200):
            if router.cached_tokens(w1, keys) == 20:
                break
            await asyncio.sleep(0.02)
        assert router.cached_tokens(w1, keys) == 20 and router.cached_tokens(w0, keys) == 0
        # what Watch published are not the prompt's raw hashes, nor another tenant's keys
        assert router.cached_tokens(w1, PromptKeys(prompt)) == 0
        assert router.cached_tokens(w1, PromptKeys(prompt, prefix_root(salt, "tenant-b"))) == 0
        assert all(router.pick("decode", keys) is w1 for _ in range(4))
        assert router.describe(w1)["prefix_cache_blocks"] == router.prefix_index.num_keys(
            w1.address) > 0
        # The worker goes away: its keys are forgotten (stale keys would attract requests).
        await handles[1].stop(0)
        for _ in range(200):
            if router.prefix_index.block_size(w1.address) is None:
                break
            await asyncio.sleep(0.02)
        assert router.cached_tokens(w1, keys) == 0
    finally:
        await router.stop()
        await channel.close()
        await backend.close()
        for h in handles:
            await h.stop(0)


def test_a_request_that_just_ended_does_not_keep_its_worker_busy() -> None:
    router, (d0, d1) = router_of(2)
    cache(router, "d0", SYSTEM)
    cache(router, "d1", [])
    prompt = PromptKeys(SYSTEM[: 2 * BS] + [1])  # 2 cached blocks on d0: worth half a request
    with router.lease(d0):
        assert d0.load()[0] == 1
    # d0's last stats (polled while the request ran) still count it; the gateway knows it ended.
    d0.stats = common_pb2.WorkerStats(block_size=BS, num_running=1)
    assert d0.load()[0] == 0 and router.pick("decode", prompt) is d0
    d1.stats = common_pb2.WorkerStats(block_size=BS, num_running=2)  # another gateway's load
    assert d1.load()[0] == 2


async def test_a_worker_that_comes_up_late_is_watched_at_once(  # type: ignore[no-untyped-def]
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.decode.server import start_decode_worker
    from services.engine.core.loaders import load_model
    from services.engine.runtime.worker_options import WorkerOptions
    from services.gateway import prefix_index
    from services.gateway.backend import Backend
    from services.gateway.config import GatewayConfig
    from tests.ports import free_ports

    monkeypatch.setattr(prefix_index, "RETRY_MIN_S", 60.0)  # only a wake-up can resubscribe soon
    port = free_ports(1)[0]
    config = GatewayConfig(tokenizer_addresses=("127.0.0.1:1",), prefill_addresses=(),
                           decode_addresses=(f"127.0.0.1:{port}",),
                           tls=tls_for("gateway"))  # fmt: skip
    backend = Backend(config)
    router = Router(backend.prefill, backend.decode, interval_s=0.1)
    model = load_model(str(tiny_llama_dir))
    router.model_fingerprint = model.fingerprint  # what the tokenizer would report
    handle = None
    try:
        await router.start()  # nothing listens yet: the first subscription fails
        await asyncio.sleep(0.3)
        handle = await start_decode_worker(
            WorkerOptions(tls=tls_for("decode"),
                          host="127.0.0.1", port=port, num_blocks=16, worker_id="late"),
            loaded=model)  # fmt: skip
        address = f"127.0.0.1:{port}"
        for _ in range(100):
            if router.prefix_index.block_size(address) is not None:
                break
            await asyncio.sleep(0.05)
        assert router.prefix_index.block_size(address) == 16  # the snapshot came, long before 60 s
    finally:
        await router.stop()
        await backend.close()
        if handle is not None:
            await handle.stop(0)


async def test_a_request_ending_during_a_stats_poll_is_not_counted_again() -> None:
    router, (d0, _) = router_of(2)
    router.model_fingerprint = "0123456789abcdef"

    class SlowStats:
        role, address = "decode", "d0"

        async def health(self) -> str:
            return "SERVING"

        async def stats(self) -> common_pb2.WorkerStats:
            with router.lease(d0):  # was running when the snapshot was taken...
                assert d0.in_flight == 1
            # ...and ended before the answer arrived
            return common_pb2.WorkerStats(block_size=BS, num_running=1,
                                          protocol_version=PROTOCOL_VERSION,
                                          model_fingerprint="0123456789abcdef")

    d0.client = SlowStats()  # type: ignore[assignment]
    await router._poll(d0)
    assert d0.finished_since_poll == 1 and d0.load()[0] == 0
