"""A decode worker under attack from inside the deployment's network (issues 32 and 47), on real
prefill and decode workers (gRPC over mutual TLS on 127.0.0.1, the tiny model): a ``Reserve``
flood and forged ``TransferKV`` streams change nothing for a well-behaved request running at the
same time, what a flood may hold is bounded per caller (its certificate) and in total from the
first reservation (services/engine/kv_transfer/reservation_quota.py), KV forged with a valid
prefill certificate for a prefix another tenant uses leaves that tenant's output and
``cached_tokens`` unchanged (services/engine/kv_transfer/receiver.py: a transfer needs a
reservation for its own prompt and salt), and a prefill worker ships KV only to a current decode
member (services/common/member_addresses.py)."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from services.common.cert_authority import issue
from services.common.errors import ResourceExhaustedError
from services.common.grpc_channel import open_channel
from services.common.internal_tls import InternalTls
from services.common.member_addresses import MemberAddresses
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.peer_roles import caller_identity, peer_identity
from services.common.prefix_hash import reservation_digest
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_to_proto
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.kv_transfer import ReceiveState
from services.engine.kv_transfer.reservation_quota import ReservationQuota
from tests.prefill_decode_cluster import Cluster, cluster, prompt_of, reference, tokens_of
from tests.tls_identities import session_ca, tls_for

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
POOL = 64  # decode blocks in these tests
FLOOD_POOL = 256  # the flood test's: its bounds (64 per caller, 128 in all) are above one
# full-context prompt (32 blocks of the 512-token context), which neither bound goes below


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir))


def other_identity(role: str) -> InternalTls:
    """A second certificate of ``role`` from the deployment CA: another process, another
    caller."""
    issued = issue(session_ca(), role)
    return InternalTls.from_pem(issued.cert_pem, issued.key_pem, session_ca().cert_pem)


async def flood(stub: decode_pb2_grpc.DecodeStub, prefix: str, tries: int = 64) -> list[int]:
    """Reserve 64-token chunks until refused; the blocks each granted reservation holds."""
    granted = []
    for i in range(tries):
        try:
            grant = await stub.Reserve(decode_pb2.ReserveRequest(
                request_id=f"{prefix}-{i}", num_tokens=64, lease_seconds=600,
                prompt_digest=reservation_digest(prompt_of(64, offset=i), "")))  # fmt: skip
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-reserved" in (err.details() or "")
            break
        granted.append(grant.num_blocks)
    return granted


def test_quota_bounds_per_caller_and_in_total() -> None:
    quota = ReservationQuota(total_fraction=0.5, caller_fraction=0.25)
    quota.check(num_blocks=4, held_by_caller=12, held_total=12, pool_blocks=64)
    with pytest.raises(ResourceExhaustedError, match="max-reserved-per-caller"):
        quota.check(num_blocks=5, held_by_caller=12, held_total=12, pool_blocks=64)
    quota.check(num_blocks=4, held_by_caller=4, held_total=28, pool_blocks=64)
    with pytest.raises(ResourceExhaustedError, match="max-reserved-fraction"):
        quota.check(num_blocks=5, held_by_caller=4, held_total=28, pool_blocks=64)
    # counted from the first reservation: a caller holding nothing gets no pass on either bound
    with pytest.raises(ResourceExhaustedError, match="max-reserved-per-caller"):
        quota.check(num_blocks=17, held_by_caller=0, held_total=0, pool_blocks=64)
    with pytest.raises(ResourceExhaustedError, match="max-reserved-fraction"):
        quota.check(num_blocks=4, held_by_caller=0, held_total=30, pool_blocks=64)
    # but neither bound is below one prompt of the longest the worker accepts (here 40
    # blocks): such a prompt alone is never refused by a fraction, only by the room left
    quota.check(num_blocks=40, held_by_caller=0, held_total=0, pool_blocks=64,
                largest_prompt_blocks=40)  # fmt: skip
    with pytest.raises(ResourceExhaustedError, match="max-reserved-fraction"):
        quota.check(num_blocks=40, held_by_caller=0, held_total=4, pool_blocks=64,
                    largest_prompt_blocks=40)  # fmt: skip
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(Exception):
            ReservationQuota(total_fraction=bad).validate()


def test_a_caller_is_its_certificate_not_its_address() -> None:
    uri = {"peer_spiffe_id": [b"spiffe://tandem/gateway"]}
    a = caller_identity("ipv4:10.0.0.5:41234", {**uri, "x509_pem_cert": [b"A"]})
    assert a.startswith("spiffe://tandem/gateway#")  # the role it proves, and which certificate
    # the same certificate from another port or another host is the same caller
    assert a == caller_identity("ipv4:10.0.0.5:50000", {**uri, "x509_pem_cert": [b"A"]})
    assert a == caller_identity("ipv4:10.0.0.9:41234", {**uri, "x509_pem_cert": [b"A"]})
    # another certificate is another caller, even from the same address
    assert a != caller_identity("ipv4:10.0.0.5:41234", {**uri, "x509_pem_cert": [b"B"]})
    # the URI SANs count when gRPC gives no single SPIFFE id
    sans = {"x509_subject_alternative_name": [b"gateway.tandem.internal",
                                              b"spiffe://tandem/gateway"], "x509_pem_cert": [b"A"]}
    assert caller_identity("ipv4:10.0.0.5:1", sans) == a
    # without TLS the address is all there is
    assert caller_identity("ipv6:[::1]:5000", {}) == "address:ipv6:[::1]"


def test_peer_identity_tells_processes_apart() -> None:
    a = peer_identity("ipv4:10.0.0.5:41234", {"x509_pem_cert": [b"A"]})
    assert a == peer_identity("ipv4:10.0.0.5:50000", {"x509_pem_cert": [b"A"]})  # same process
    assert a != peer_identity("ipv4:10.0.0.5:41234", {"x509_pem_cert": [b"B"]})
    assert a != peer_identity("ipv4:10.0.0.6:41234", {"x509_pem_cert": [b"A"]})
    assert peer_identity("ipv6:[::1]:5000", {}) == "ipv6:[::1]"


async def test_a_reserve_flood_changes_nothing_for_a_running_request(model: LoadedModel) -> None:
    prompt = prompt_of(40)
    expected = reference(model, [prompt], PARAMS)[0]
    async with cluster(model, decode_blocks=FLOOD_POOL) as c:
        identity = other_identity("gateway")
        attacker = open_channel(c.decode_handle.address, tls=identity)
        same_cert = open_channel(c.decode_handle.address, tls=identity)  # another connection
        second_channel = open_channel(c.decode_handle.address, tls=other_identity("gateway"))
        try:
            stub = decode_pb2_grpc.DecodeStub(attacker)
            good = asyncio.create_task(c.run("good", prompt, PARAMS))
            granted = await flood(stub, "flood")
            # one caller holds at most a quarter of the pool, its first grant counted
            assert sum(granted) == FLOOD_POOL // 4
            # another connection with the same certificate is the same caller: nothing more
            assert await flood(decode_pb2_grpc.DecodeStub(same_cert), "flood1b") == []
            _, messages = await good
            assert tokens_of(messages) == expected
            # the well-behaved caller still reserves and serves, beside the flood
            _, messages = await c.run("good2", prompt, PARAMS)
            assert tokens_of(messages) == expected
            # another certificate floods too: all reservations together stay within half
            more = await flood(decode_pb2_grpc.DecodeStub(second_channel), "flood2")
            assert 0 < sum(more) and sum(granted) + sum(more) <= FLOOD_POOL // 2
            stats = c.decode_handle.engine_loop.stats
            assert stats.num_preemptions == 0
            for prefix, grants in (("flood", granted), ("flood2", more)):
                for i in range(len(grants)):
                    await stub.Abort(common_pb2.AbortRequest(request_id=f"{prefix}-{i}"))
            await c.wait_idle()
        finally:
            for channel in (attacker, same_cert, second_channel):
                await channel.close()


def _forged(c: Cluster, rid: str, tokens: list[int], *, corrupt: bool,
            params: SamplingParams = PARAMS) -> AsyncIterator[decode_pb2.KVTransferMessage]:
    receiver = c.decode_handle.worker.receiver
    blocks = -(-len(tokens) // receiver.layout.block_size)
    total = blocks * receiver.block_bytes
    data = b"\x7f" * total  # KV the attacker chose

    async def messages() -> AsyncIterator[decode_pb2.KVTransferMessage]:
        yield decode_pb2.KVTransferMessage(header=decode_pb2.KVHeader(
            request_id=rid, layout=receiver.layout, num_tokens=len(tokens), num_blocks=blocks,
            total_bytes=total, prompt_token_ids=tokens, first_token_id=7,
            params=sampling_params_to_proto(params), num_prompt_tokens=len(tokens)))
        crc = zlib.crc32(data) ^ (1 if corrupt else 0)
        yield decode_pb2.KVTransferMessage(chunk=decode_pb2.KVChunk(
            first_block=0, num_blocks=blocks, data=data, crc32=crc, offset=0))
        yield decode_pb2.KVTransferMessage(commit=decode_pb2.KVCommit(num_chunks=1,
                                                                      total_bytes=total))
    return messages()  # fmt: skip


async def test_forged_transfers_change_nothing_for_a_running_request(model: LoadedModel) -> None:
    prompt = prompt_of(40)
    expected = reference(model, [prompt], PARAMS)[0]
    async with cluster(model, decode_blocks=POOL) as c:
        good = asyncio.create_task(c.run("good", prompt, PARAMS))
        gateway_channel = open_channel(c.decode_handle.address, tls=tls_for("gateway"))
        prefill_channel = open_channel(c.decode_handle.address, tls=other_identity("prefill"))
        # a gateway's certificate may not send KV at all
        as_gateway = decode_pb2_grpc.DecodeStub(gateway_channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await as_gateway.TransferKV(_forged(c, "forged-a", prompt, corrupt=False))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # a prefill certificate with a chunk that fails its checksum: DATA_LOSS, nothing kept
        as_prefill = decode_pb2_grpc.DecodeStub(prefill_channel)
        await c.reserve("forged-b", prompt, PARAMS)  # even for a reserved request
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await as_prefill.TransferKV(_forged(c, "forged-b", prompt, corrupt=True))
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        assert c.decode_handle.worker.receiver.state("forged-b") in (None, ReceiveState.FAILED)
        with pytest.raises(grpc.aio.AioRpcError):  # its Generate gets an error, never tokens
            async for _ in c.generate("forged-b", wait=1.0):
                pass
        # a prefill certificate with KV nobody reserved for: refused before a byte is taken
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await as_prefill.TransferKV(_forged(c, "forged-c", prompt, corrupt=False))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert c.decode_handle.worker.receiver.state("forged-c") is None
        _, messages = await good
        assert tokens_of(messages) == expected
        # the refused KV never entered the prefix cache: the same prompt still decodes right
        _, messages = await c.run("after", prompt, PARAMS)
        assert tokens_of(messages) == expected
        await c.wait_idle()
        await gateway_channel.close()
        await prefill_channel.close()


async def test_member_addresses_follow_dns() -> None:
    answers = {"decode": ["10.0.0.1:50071", "10.0.0.2:50071"]}
    now = [0.0]

    async def resolver(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError("no such host")
        return answers[host]

    members = MemberAddresses(["decode:50071", "10.9.9.9:7"], refresh_s=5.0, resolver=resolver,
                              clock=lambda: now[0])  # fmt: skip
    assert await members.allows("10.0.0.2:50071") and await members.allows("10.9.9.9:7")
    assert not await members.allows("10.0.0.3:50071")  # not (yet) a member
    assert not await members.allows("decode:50071")  # names are never sent, addresses are
    answers["decode"] = ["10.0.0.3:50071"]  # a replica came, the others left
    assert not await members.allows("10.0.0.3:50071")  # resolved less than 5 s ago
    now[0] = 6.0
    assert await members.allows("10.0.0.3:50071")
    assert not await members.allows("10.0.0.1:50071")
    del answers["decode"]  # a DNS hiccup keeps the members known
    now[0] = 12.0
    assert not await members.allows("10.0.0.4:50071") and await members.allows("10.0.0.3:50071")
    assert await MemberAddresses(()).allows("192.0.2.1:1")  # no entries: anything
    assert await MemberAddresses(["localhost:5000"]).allows("127.0.0.1:5000")  # real DNS


async def test_prefill_refuses_a_decode_address_outside_its_members(model: LoadedModel) -> None:
    async with cluster(model, prefill_kw={"decode_members": ["127.0.0.1:1"]}) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill("elsewhere", prompt_of(20), reserve=False)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a decode worker of this deployment" in (err.value.details() or "")
        pre, dec = await c.stats()
        assert pre.kv_blocks_in_use == 0 and dec.kv_blocks_in_use == 0  # nothing computed


async def local_run(c: Cluster, rid: str, prompt: list[int], params: SamplingParams
                    ) -> tuple[list[int], int]:  # fmt: skip
    """A request the decode worker prefills itself (its prefix cache serves it): its tokens and
    its ``num_cached_tokens``."""
    request = decode_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                         params=sampling_params_to_proto(params))  # fmt: skip
    messages = [m async for m in c.decode_stub.Generate(request)]
    return tokens_of(messages), messages[-1].num_cached_tokens


async def test_forged_kv_for_another_tenant_s_prefix_changes_nothing_for_that_tenant(
    model: LoadedModel,
) -> None:
    """A process holding a valid prefill certificate forges ``TransferKV`` streams carrying KV it
    chose for the prefix a tenant uses, under that tenant's salt: with no reservation, by taking
    over a reservation the gateway made for another tenant's request of the same prompt, and as
    that other tenant's own KV. The tenant's output and ``cached_tokens`` stay what a clean
    worker gives."""
    prompt = prompt_of(48)  # three full 16-token blocks: what the prefix cache keeps
    victim = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            cache_salt="tenant-victim")  # fmt: skip
    attacker = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                              cache_salt="tenant-attacker")  # fmt: skip
    expected = reference(model, [prompt], victim)[0]
    async with cluster(model, decode_blocks=POOL) as c:
        forger = open_channel(c.decode_handle.address, tls=other_identity("prefill"))
        try:
            as_prefill = decode_pb2_grpc.DecodeStub(forger)
            # 1. no reservation: refused
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await as_prefill.TransferKV(_forged(c, "x-1", prompt, corrupt=False,
                                                    params=victim))  # fmt: skip
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # 2. the gateway reserved for the attacker tenant's request of the same prompt; the
            # forger brings it under the victim's salt: refused, the reservation left intact
            await c.reserve("a-1", prompt, attacker)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await as_prefill.TransferKV(_forged(c, "a-1", prompt, corrupt=False,
                                                    params=victim))  # fmt: skip
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "cache_salt" in (err.value.details() or "")
            assert c.decode_handle.worker.receiver.state("a-1") is ReceiveState.RESERVED
            # 3. under the attacker's own salt the forged KV is taken (the reservation is for
            # it) and decoded: its blocks enter the cache, under the attacker's salt only
            ack = await as_prefill.TransferKV(_forged(c, "a-1", prompt, corrupt=False,
                                                      params=attacker))  # fmt: skip
            assert ack.accepted
            assert [m async for m in c.generate("a-1")][-1].finish_reason == "length"
            # the victim: the output and cached_tokens of a clean worker (nothing cached)
            tokens, cached = await local_run(c, "victim-1", prompt, victim)
            assert (tokens, cached) == (expected, 0)
            # and its own requests still share its own cache as before
            tokens, cached = await local_run(c, "victim-2", prompt, victim)
            assert tokens == expected and cached > 0
            await c.wait_idle()
        finally:
            await forger.close()
