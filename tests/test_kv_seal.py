"""The KV payload on a collective channel is sealed (``payload_seal.py``): an on-path attacker
who changes a piece's bytes so that its CRC-32 stays the same (a CRC is linear: always possible)
gets the transfer refused with DATA_LOSS, and the bytes on the wire are not the KV.

Real prefill and decode workers with ``--kv-transport distributed`` (Gloo pair groups), the
attacker played by a wrapper around the pair group's send.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import grpc
import pytest

from services.common.errors import DataLossError
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.kv_transfer import distributed_endpoint
from services.engine.kv_transfer.pair_group import PairGroup
from services.engine.kv_transfer.payload_seal import new_key, seal, unseal
from tests.prefill_decode_cluster import cluster, prompt_of


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir))


def crc_preserving_change(data: bytes) -> bytes:
    """``data`` with its first bit flipped and 32 bits of its last four bytes chosen so that
    zlib.crc32 is unchanged: for equal lengths crc(a ^ b) = crc(a) ^ crc(b) ^ crc(0...0), so solve
    over GF(2) for the correction."""
    n = len(data)
    zero = zlib.crc32(bytes(n))

    def effect(bit: int) -> int:
        delta = bytearray(n)
        delta[bit // 8] ^= 1 << (bit % 8)
        return zlib.crc32(bytes(delta)) ^ zero

    target = effect(0)
    basis: list[tuple[int, int]] = []  # (crc effect, mask of correction bits), reduced
    for i in range(32):
        vec, mask = effect(8 * (n - 4) + i), 1 << i
        for b_vec, b_mask in basis:
            if vec ^ b_vec < vec:
                vec, mask = vec ^ b_vec, mask ^ b_mask
        if vec:
            basis.append((vec, mask))
    basis.sort(reverse=True)
    chosen = 0
    for b_vec, b_mask in basis:
        if target ^ b_vec < target:
            target, chosen = target ^ b_vec, chosen ^ b_mask
    assert target == 0, "32 independent correction bits always reach any CRC"
    changed = bytearray(data)
    changed[0] ^= 1
    for i in range(32):
        if chosen >> i & 1:
            changed[n - 4 + i // 8] ^= 1 << (i % 8)
    return bytes(changed)


def test_the_crc_alone_would_have_let_the_change_through() -> None:
    data = bytes(range(256)) * 40
    changed = crc_preserving_change(data)
    assert changed != data and zlib.crc32(changed) == zlib.crc32(data)
    key = new_key()
    sealed, tag = seal(key, 4096, data)
    assert sealed != data and len(sealed) == len(data)
    assert unseal(key, 4096, sealed, tag) == data
    for bad in (crc_preserving_change(sealed), sealed):
        with pytest.raises(DataLossError, match="authentication tag"):
            unseal(key, 4096 if bad is not sealed else 0, bad, tag)  # changed, or moved


async def test_a_changed_piece_on_the_gloo_wire_is_data_loss(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[bytes] = []
    attacked: list[int] = []
    original = PairGroup.send

    async def on_path(self: PairGroup, data: bytes, tag: int) -> None:
        sent.append(data)
        if len(sent) == 2 and not attacked:  # the second piece, changed with its CRC-32 kept
            attacked.append(len(data))
            data = crc_preserving_change(data)
        await original(self, data, tag)

    opened: list[bytes] = []

    def recording_unseal(key: bytes, offset: int, sealed: bytes, tag: bytes) -> bytes:
        data = unseal(key, offset, sealed, tag)
        opened.append(data)
        return data

    monkeypatch.setattr(PairGroup, "send", on_path)
    monkeypatch.setattr(distributed_endpoint, "unseal", recording_unseal)
    async with cluster(model, transport="distributed", prefill_kw={"max_chunk_bytes": 8192}) as c:
        call = c.generate("attacked")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill("attacked", prompt_of(60))
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        with pytest.raises(grpc.aio.AioRpcError) as gen_err:
            async for _ in call:
                pass
        assert gen_err.value.code() == grpc.StatusCode.DATA_LOSS
        assert "authentication tag" in (gen_err.value.details() or "")
        await c.wait_idle()
        # the KV itself never crossed the wire: each piece went over encrypted
        sent.clear()
        opened.clear()
        _, responses = await c.run("clean", prompt_of(60))
        assert responses[-1].finish_reason == "length" and len(sent) == len(opened) > 1
        for wire, kv in zip(sent, opened):
            assert len(wire) == len(kv) and wire != kv
        await c.wait_idle()
