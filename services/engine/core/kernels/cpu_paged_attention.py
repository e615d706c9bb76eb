"""Python side of the CPU paged decode-attention kernel (``cpu_paged_attention.c``).

:class:`CpuPagedAttention` is the :class:`~services.engine.core.attention.PagedAttention` backend that
``auto`` picks on CPU: float32 decode steps go through the C kernel, which reads K/V in place
from the paged pool (no gathered copy, no padding mask); prefill steps, caches in other dtypes,
and machines where the kernel can't be built use the torch reference it inherits.
:func:`load_cpu_attention` builds the kernel once per process (for the selected instruction set)
or returns ``None`` (one log line saying why); ``TANDEM_CPU_KERNELS=0`` turns it off.

Like the matmul kernels it proves itself: :meth:`CpuPagedAttention.tune` (called by the model
runner once the model is loaded) times it against the torch reference on the model's head shape
at batch 1, 8 and 32 over a 256-token context (:mod:`services.engine.core.kernels.autotune`, cached),
and a batch size where the reference was faster runs the reference.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from services.engine.core.attention import AttentionMetadata, TorchPagedAttention
from services.engine.core.kernels.autotune import KernelRegimes, choose_regimes
from services.engine.core.kernels.native_build import load_kernel, selected_isa

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def load_cpu_attention() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C entry point, built for this machine, or ``None`` when off or not buildable here."""
    library = load_kernel(SOURCE, lambda lib: lib, "CPU decode-attention kernel")
    if library is None:
        return None
    fn = library.tandem_paged_decode_attention
    fn._tandem_build = library._name  # the cached build's path, for the autotune cache key
    fn.restype = None
    fn.argtypes = [
        _PTR, _I64, _I64,
        _PTR, _I64, _I64, _I64,
        _PTR, _I64, _I64, _I64,
        _PTR, _I64, _PTR, _PTR,
        _I64, _I64, _I64, _I64, _I64,
        ctypes.c_float, ctypes.c_int,
        _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR,
    ]  # fmt: skip
    return fn


def cpu_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q ``[B, H, D]``, caches ``[NB, BS, KVH, D]`` (strided views; D contiguous), int64
    ``block_tables [B, max_blocks]`` and ``context_lens [B]`` → ``[B, H, D]`` float32.

    ``new_kv`` = (k and v ``[B, KVH, D]`` with D contiguous, int64 slot blocks ``[B]``, slot
    offsets ``[B]``): write this step's K/V into the cache first, in the same call."""
    fn = load_cpu_attention()
    if fn is None:
        raise RuntimeError("the CPU decode-attention kernel is not available")
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be float32 with a contiguous head dimension")
    tables, lens = _int64(block_tables), _int64(context_lens)
    store: tuple[int | None, ...] = (None, 0, 0, None, 0, 0, None, None)
    if new_kv is not None:
        k, v, blocks, offsets = new_kv
        if (
            k.shape != (batch, kv_heads, head_dim) or v.shape != k.shape
            or k.stride(-1) != 1 or v.stride(-1) != 1
            or k.dtype != torch.float32 or v.dtype != torch.float32
            or blocks.numel() != batch or offsets.numel() != batch
        ):  # fmt: skip
            raise ValueError("new K/V must be float32 [B, KVH, D], D contiguous, one slot per row")
        blocks, offsets = _int64(blocks), _int64(offsets)
        store = (k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                 blocks.data_ptr(), offsets.data_ptr())  # fmt: skip
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32)
    fn(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(), out.data_ptr(),
        batch, heads, kv_heads, head_dim, block_size,
        scale, torch.get_num_threads(), *store,
    )  # fmt: skip
    return out


def _int64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


class CpuPagedAttention(TorchPagedAttention):
    """Float32 decode steps through the C kernel (built at the first one); the rest, and
    everything when the kernel can't be built here, through the torch reference."""

    regimes = KernelRegimes()  # kernel for every batch until tune() measures
    TUNE_BATCHES = (1, 8, 32)
    TUNE_CONTEXT = 256

    def tune(self, heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
        """Time the kernel against the torch reference for this head shape (once per build)."""
        fn = load_cpu_attention()
        if fn is None or self.regimes.measured:
            return
        context, batches = self.TUNE_CONTEXT, self.TUNE_BATCHES
        per_seq = -(-context // block_size)
        blocks = per_seq * max(batches) + 1
        gen = torch.Generator().manual_seed(0)
        k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen)
        v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen)
        metas = {}
        for batch in batches:
            tables = [[1 + b * per_seq + i for i in range(per_seq)] for b in range(batch)]
            metas[batch] = AttentionMetadata.build(
                is_prefill=False, query_lens=[1] * batch, context_lens=[context] * batch,
                block_tables=tables, block_size=block_size,
            )  # fmt: skip
        queries = {b: torch.randn(b, heads, head_dim, generator=gen) for b in batches}
        scale = head_dim**-0.5

        def runner(kernel: bool):  # type: ignore[no-untyped-def]
            def run(batch: int) -> None:
                meta, q = metas[batch], queries[batch]
                if kernel:
                    cpu_paged_decode_attention(
                        q, k_cache, v_cache, meta.block_tables, meta.decode_context_lens(), scale
                    )
                else:
                    TorchPagedAttention.decode(self, q, k_cache, v_cache, meta, scale)

            return run

        self.regimes = choose_regimes(
            "decode-attention",
            isa=selected_isa(),
            build=Path(str(getattr(fn, "_tandem_build", "?"))).name,
            shapes=[(heads, kv_heads, head_dim, block_size, context)],
            run_kernel=runner(True),
            run_torch=runner(False),
            rows=batches,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """A decode step the kernel takes stores K/V and attends in one call."""
        if meta.is_prefill or not self._kernel_takes(q, k_cache):
            return super().forward(q, k, v, k_cache, v_cache, meta, scale)
        return cpu_paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.decode_context_lens(), scale,
            new_kv=(k, v, meta.slot_blocks, meta.slot_offsets),
        )  # fmt: skip

    def native_decode(self, batch: int) -> bool:
        return self.regimes.kernel_for(batch) and load_cpu_attention() is not None

    def _kernel_takes(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (
            q.dtype == torch.float32
            and k_cache.dtype == torch.float32
            and self.regimes.kernel_for(q.shape[0])
            and load_cpu_attention() is not None
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if not self._kernel_takes(q, k_cache):
            return super().decode(q, k_cache, v_cache, meta, scale)
        return cpu_paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.decode_context_lens(), scale
        )
