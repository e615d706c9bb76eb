"""Python side of the CPU paged-attention kernels (``cpu_paged_attention.c``): decode and prefill.

:class:`CpuPagedAttention` is the :class:`~services.engine.core.attention.PagedAttention` backend that
``auto`` picks on CPU. Float32 decode steps go through the decode kernel, which reads K/V in place
from the paged pool (no gathered copy, no padding mask). Float32 prefill steps go through the
prefill kernel: causal attention of every prompt's rows over the cache (a cached prefix and
several prompts included, none padded), as blocked GEMMs with an online softmax; PyTorch's
fused CPU attention takes one uncached prompt at a time and pads the rest under a mask.
Caches in other dtypes, and machines where the kernels can't be built, use the torch reference
it inherits. :func:`load_cpu_attention` / :func:`load_cpu_prefill_attention` build the kernels
once per process (for the selected instruction set) or return ``None`` (one log line saying
why); ``TANDEM_CPU_KERNELS=0`` turns them off.

Like the matmul kernels they prove themselves: :meth:`CpuPagedAttention.tune` (called by the model
runner once the model is loaded) times the decode kernel against the torch reference on the
model's head shape at batch 1, 8 and 32 over a 256-token context, and the prefill kernel on one
prompt of 64 and of 512 tokens (:mod:`services.engine.core.kernels.autotune`, cached); wherever
the reference was faster, the reference runs.
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
# the prefill kernel walks the head dimension in whole vectors of the widest set (AVX-512's 16
# floats); other head sizes take the torch reference
KERNEL_HEAD_DIM_MULTIPLE = 16


@functools.cache
def load_cpu_attention() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The decode entry point, built for this machine, or ``None`` when off or not buildable here.
    The prefill entry point of the same build rides on it (:func:`load_cpu_prefill_attention`),
    so clearing this cache forgets both."""
    library = load_kernel(SOURCE, lambda lib: lib, "CPU paged-attention kernels")
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
    prefill = library.tandem_paged_prefill_attention
    prefill.restype = None
    prefill.argtypes = [
        _PTR, _I64, _I64,
        _PTR, _I64, _I64, _I64,
        _PTR, _I64, _I64, _I64,
        _PTR, _I64, _PTR, _PTR,
        _PTR, _I64, _I64, _I64, _I64,
        _I64, ctypes.c_float, ctypes.c_int,
    ]  # fmt: skip
    fn._tandem_prefill = prefill
    return fn


def load_cpu_prefill_attention() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The prefill entry point of :func:`load_cpu_attention`'s build, or ``None``."""
    return getattr(load_cpu_attention(), "_tandem_prefill", None)


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


def cpu_paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: list[int],
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of a prefill step's queries over the paged cache, which already holds
    the step's K/V: q ``[T, H, D]`` (strided; D contiguous; sequence after sequence, ``query_lens``
    rows each, at the last positions of its ``context_lens``), caches ``[NB, BS, KVH, D]``,
    int64 ``block_tables [B, max_blocks]`` → ``[T, H, D]`` float32."""
    fn = load_cpu_prefill_attention()
    if fn is None:
        raise RuntimeError("the CPU prefill-attention kernel is not available")
    tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be float32 with a contiguous head dimension")
    if head_dim % KERNEL_HEAD_DIM_MULTIPLE:
        raise ValueError(f"head_dim must be a multiple of {KERNEL_HEAD_DIM_MULTIPLE}")
    if sum(query_lens) != tokens or len(context_lens) != len(query_lens):
        raise ValueError("query_lens must cover q's rows, one per sequence with its context_lens")
    if any(c < n for c, n in zip(context_lens, query_lens, strict=True)):
        raise ValueError("a sequence's context must hold its query rows")
    tables = _int64(block_tables)
    lens = torch.tensor([context_lens, query_lens], dtype=torch.int64)
    out = torch.empty(tokens, heads, head_dim, dtype=torch.float32)
    fn(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tables.data_ptr(), tables.stride(0), lens[0].data_ptr(), lens[1].data_ptr(),
        out.data_ptr(), len(query_lens), heads, kv_heads, head_dim,
        block_size, scale, torch.get_num_threads(),
    )  # fmt: skip
    return out


def _int64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


class CpuPagedAttention(TorchPagedAttention):
    """Float32 decode steps through the C kernel (built at the first one); the rest, and
    everything when the kernel can't be built here, through the torch reference."""

    regimes = KernelRegimes()  # kernel for every batch until tune() measures
    prefill_regimes = KernelRegimes(rows=(64, 512), use_kernel=(True, True))
    TUNE_BATCHES = (1, 8, 32)
    TUNE_CONTEXT = 256
    TUNE_PROMPTS = (64, 512)

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
        self._tune_prefill(heads, kv_heads, head_dim, block_size)

    def _tune_prefill(self, heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
        """Time the prefill kernel against the torch reference on one uncached prompt of each of
        :attr:`TUNE_PROMPTS` tokens (PyTorch's fused attention takes that case directly)."""
        fn = load_cpu_prefill_attention()
        if fn is None or self.prefill_regimes.measured or head_dim % KERNEL_HEAD_DIM_MULTIPLE:
            return
        prompts = self.TUNE_PROMPTS
        blocks = -(-max(prompts) // block_size)
        gen = torch.Generator().manual_seed(0)
        k_cache = torch.randn(blocks + 1, block_size, kv_heads, head_dim, generator=gen)
        v_cache = torch.randn(blocks + 1, block_size, kv_heads, head_dim, generator=gen)
        cases = {}
        for n in prompts:
            meta = AttentionMetadata.build(
                is_prefill=True, query_lens=[n], context_lens=[n],
                block_tables=[list(range(1, 2 + (n - 1) // block_size))], block_size=block_size,
            )  # fmt: skip
            qkv = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=gen)
            q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
            TorchPagedAttention.store_kv(k, v, k_cache, v_cache, meta)
            cases[n] = (q, k, v, meta)
        scale = head_dim**-0.5

        def runner(kernel: bool):  # type: ignore[no-untyped-def]
            def run(n: int) -> None:
                q, k, v, meta = cases[n]
                if kernel:
                    cpu_paged_prefill_attention(q, k_cache, v_cache, meta.block_tables,
                                                meta.context_lens, meta.query_lens, scale)  # fmt: skip
                else:
                    TorchPagedAttention.prefill(self, q, k, v, k_cache, v_cache, meta, scale)

            return run

        self.prefill_regimes = choose_regimes(
            "prefill-attention",
            isa=selected_isa(),
            build=Path(str(getattr(load_cpu_attention(), "_tandem_build", "?"))).name,
            shapes=[(heads, kv_heads, head_dim, block_size)],
            run_kernel=runner(True),
            run_torch=runner(False),
            rows=prompts,
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
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """A decode step the kernel takes stores K/V and attends in one call."""
        if (
            meta.is_prefill
            or window is not None
            or softcap is not None
            or not self._kernel_takes(q, k_cache)
        ):
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
        return cpu_paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.decode_context_lens(), scale,
            new_kv=(k, v, meta.slot_blocks, meta.slot_offsets),
        )  # fmt: skip

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """The step's prompts through the prefill kernel (K/V already stored), when it takes them."""
        if (
            q.dtype != torch.float32
            or k_cache.dtype != torch.float32
            or q.shape[-1] % KERNEL_HEAD_DIM_MULTIPLE
            or not self.prefill_regimes.kernel_for(q.shape[0])
            or load_cpu_prefill_attention() is None
        ):
            return super().prefill(q, k, v, k_cache, v_cache, meta, scale)
        return cpu_paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_lens, scale
        )

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
