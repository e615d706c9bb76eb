"""An in-process prefill / decode pair over the CUDA IPC KV transport with torch's two IPC calls
faked on CPU, for tests/test_cuda_ipc.py, tests/test_cuda_ipc_failures.py and the GPU test
(tests/test_cuda_ipc_gpu.py).

:class:`FakeIpc`: "mapping" a pool returns the prefill engine's own pool tensor, which is what a
real mapping shows. :class:`Recording` keeps every message an endpoint saw. :class:`IpcPair`: a
prefill engine loop and sender, a decode engine loop, receiver and IPC endpoint, in one process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch

from services.common.metrics import TandemMetrics
from services.common.pb import decode_pb2
from services.common.prefix_hash import reservation_digest
from services.common.sampling_params import SamplingParams
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import LoadedModel
from services.engine.kv_transfer import InProcessTransport, KVReceiver, KVSender, PrefilledRequest
from services.engine.kv_transfer.cuda_ipc import CudaIpcEndpoint, CudaIpcKVTransport
from services.engine.kv_transfer.transport import KVTransport
from services.engine.runtime.engine_loop import EngineLoop
from tests.test_kv_transfer import wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
DECODE = "decode-0"
GPU = "3f1c9a2e-0000-4000-8000-00000000a100"  # a made-up GPU uuid


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 + offset) % 500 + 1 for i in range(n)]


class FakeIpc:
    """torch's two IPC calls on CPU: ``share`` files the pool tensor under a new binary handle,
    ``map`` returns the tensor filed under the handle (the same memory, as a mapping gives)."""

    def __init__(self) -> None:
        self.pools: dict[bytes, torch.Tensor] = {}
        self.mapped = 0
        self.fail = False
        self.blocks: int | None = None  # pretend the shared pool has this many blocks

    def share(self, data: torch.Tensor) -> decode_pb2.CudaIpcPool:
        handle = bytes([0, 255, len(self.pools)]) + b"\x00fake-cudaIpcMemHandle"
        self.pools[handle] = data
        shape = list(data.shape)
        if self.blocks is not None:
            shape[0] = self.blocks
        return decode_pb2.CudaIpcPool(
            device=0, handle=handle, storage_size_bytes=data.numel() * data.element_size(),
            ref_counter_handle=b"/torch_1_fake", event_handle=bytes(64),
            event_sync_required=True, dtype=str(data.dtype).removeprefix("torch."), shape=shape,
        )  # fmt: skip

    def map(self, pool: decode_pb2.CudaIpcPool, device: torch.device) -> torch.Tensor:
        self.mapped += 1
        if self.fail:
            raise RuntimeError("cudaIpcOpenMemHandle: invalid device context (fake)")
        return self.pools[pool.handle][: pool.shape[0]]


class Recording:
    """An endpoint wrapper that keeps every message of every transfer."""

    def __init__(self, inner: CudaIpcEndpoint | KVReceiver) -> None:
        self.inner = inner
        self.messages: list[decode_pb2.KVTransferMessage] = []

    async def receive(
        self,
        messages: AsyncIterator[decode_pb2.KVTransferMessage],
        on_accept: object = None,
        *caller: str,
    ) -> decode_pb2.KVTransferAck:
        """The inner endpoint's ``receive``; a channel endpoint's ``caller`` passes through."""
        async def record() -> AsyncIterator[decode_pb2.KVTransferMessage]:
            async for message in messages:
                self.messages.append(message)
                yield message

        return await self.inner.receive(record(), on_accept, *caller)  # type: ignore[arg-type]

    def of(self, kind: str) -> list[decode_pb2.KVTransferMessage]:
        return [m for m in self.messages if m.WhichOneof("kind") == kind]


class IpcPair:
    """A prefill engine loop + sender over CUDA IPC (fake) and a decode engine loop + receiver
    behind the IPC endpoint, in process."""

    def __init__(
        self, tiny: LoadedModel, *, prefill_gpu: str = GPU, decode_gpu: str = GPU,
        ipc: FakeIpc | None = None, lease_seconds: float = 30.0, plain_decode: bool = False,
    ) -> None:
        self.ipc = ipc or FakeIpc()
        self.metrics = TandemMetrics(process_metrics=False)
        self.prefill = EngineLoop(LLMEngine(tiny, EngineConfig(num_blocks=64)),
                                  metrics=self.metrics)  # fmt: skip
        self.decode = EngineLoop(LLMEngine(tiny, EngineConfig(num_blocks=64)))
        self.receiver = KVReceiver(self.decode, reap_interval=0.05)
        self.endpoint = CudaIpcEndpoint(self.receiver, gpu_uuid=decode_gpu, map_pool=self.ipc.map)
        self.recording = Recording(self.receiver if plain_decode else self.endpoint)
        self.transport = self.ipc_transport(prefill_gpu)
        self.sender = KVSender(self.prefill, self.transport, lease_seconds=lease_seconds,
                               lease_interval=0.05, max_chunk_bytes=4096, metrics=self.metrics)

    def ipc_transport(self, gpu: str = GPU, inner: KVTransport | None = None) -> CudaIpcKVTransport:
        return CudaIpcKVTransport(
            self.prefill, peer_id="prefill-0", gpu_uuid=gpu, share=self.ipc.share,
            inner=inner or InProcessTransport({DECODE: self.recording}),  # type: ignore[dict-item]
        )  # fmt: skip

    async def __aenter__(self) -> IpcPair:
        for part in (self.prefill, self.decode, self.sender, self.receiver):
            part.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sender.close()
        await self.receiver.close()
        self.endpoint.close()
        await self.prefill.stop()
        await self.decode.stop()

    async def prefill_and_send(self, rid: str, prompt: list[int]) -> object:
        final = None
        async for out in self.prefill.generate(rid, prompt, GREEDY, prefill_only=True):
            final = out
        assert final is not None and final.finish_reason == "prefilled"
        request = PrefilledRequest(rid, tuple(prompt), GREEDY, final.new_token_ids[0], None,
                                   len(final.block_ids))
        # the gateway's reservation first: the receiver takes no KV without one
        await self.receiver.reservations.reserve(rid, len(prompt),
                                    prompt_digest=reservation_digest(prompt, GREEDY.cache_salt))
        return await self.sender.send(request, DECODE)

    async def decoded(self, rid: str) -> list[int]:
        ready = await self.receiver.claim(rid, 1.0)
        tokens: list[int] = []
        async for out in self.decode.generate_prefilled(
            rid, ready.prompt_token_ids, ready.params, first_token_id=ready.first_token_id
        ):
            tokens += out.new_token_ids
        return tokens

    async def held(self, rid: str) -> list[int]:
        return await self.decode.call(lambda engine: list(self.decode.held_blocks(rid)))

    async def idle(self) -> None:
        await wait_until(lambda: self.prefill.stats.num_blocks_in_use == 0
                         and self.decode.stats.num_blocks_in_use == 0)
