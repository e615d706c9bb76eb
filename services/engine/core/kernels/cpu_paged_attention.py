"""Python side of the CPU paged-attention kernels (``cpu_paged_attention.c``): decode and prefill.

:class:`CpuPagedAttention` is the :class:`~services.engine.core.attention.PagedAttention` backend that
``auto`` picks on CPU. Decode steps go through the decode kernel, which reads K/V in place from
the paged pool (no gathered copy, no padding mask). Prefill steps go through the prefill kernel:
causal attention of every prompt's rows over the cache (a cached prefix and several prompts
included, none padded), as blocked GEMMs with an online softmax; PyTorch's fused CPU attention
takes one uncached prompt at a time and pads the rest under a mask. Both take float32 queries
over a float32, bfloat16 or float16 cache, or a ``q8_0`` one (uint8 rows of int8 quants and
float16 scales: ``kv_quant.py``) (``--kv-cache-dtype``: widened to float32 as they are read,
exactly for ``q8_0``; rounded to the cache's type as the decode kernel stores them), and the options of
sliding-window and soft-capped layers (``window``, ``softcap``). Queries in other dtypes, and
machines where the kernels can't be built, use the torch reference it inherits.
:func:`load_cpu_attention` / :func:`load_cpu_prefill_attention` build the kernels once per
process (for the selected instruction set) or return ``None`` (one log line saying why);
``TANDEM_CPU_KERNELS=0`` turns them off.

The two give a position's attention the same bits: a decode row is computed with the prefill's
arithmetic (key tiles, multiply-add order, online-softmax steps), so a token attends the same
whether it was a prompt token, a recomputed one or a generated one. That is why, unlike the
matmul kernels, they are not timed against the torch reference: where they apply they always run
(the reference is slower on every machine measured so far: docs/benchmarks.md). :func:`auto_cache_dtype` is what
``--kv-cache-dtype auto`` means here: a 16-bit cache on the instruction sets where the decode
kernel was measured to read one at least as fast as a float32 one.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from services.engine.core import kv_quant
from services.engine.core.attention import AttentionMetadata, TorchPagedAttention, _windowed_forward
from services.engine.core.kernels.native_build import load_kernel, selected_isa, vector_isa

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# the prefill kernel walks the head dimension in whole vectors of the widest set (AVX-512's 16
# floats); other head sizes take the torch reference
KERNEL_HEAD_DIM_MULTIPLE = 16
# the cache dtypes the kernels read, as the C file's KV_FLOAT32 / KV_BFLOAT16 / KV_FLOAT16 /
# KV_Q8_0 (a q8_0 cache is a uint8 tensor: kv_cache.py)
KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.uint8: 3}
# --kv-cache-dtype auto per instruction set: a 16-bit cache where the decode kernel read it at
# least as fast as float32 in bench/kv_cache_dtype.py (docs/benchmarks.md), float32 where none did
# or none was measured. A rule, not a timing at start-up: a prefill and a decode worker must
# agree on the dtype to hand KV over, and two timings of a near tie need not.
AUTO_CACHE_DTYPES: dict[str, torch.dtype] = {"avx2": torch.float16, "avx512": torch.float16}


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
        _PTR, _I64, _I64, _I64, ctypes.c_int,
        _PTR, _I64, _PTR, _PTR,
        _I64, _I64, _I64, _I64, _I64,
        ctypes.c_float, _I64, ctypes.c_float, ctypes.c_int,
        _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR,
    ]  # fmt: skip
    prefill = library.tandem_paged_prefill_attention
    prefill.restype = None
    prefill.argtypes = [
        _PTR, _I64, _I64,
        _PTR, _I64, _I64, _I64,
        _PTR, _I64, _I64, _I64, ctypes.c_int,
        _PTR, _I64, _PTR, _PTR,
        _PTR, _I64, _I64, _I64, _I64,
        _I64, ctypes.c_float, _I64, ctypes.c_float, ctypes.c_int,
    ]  # fmt: skip
    fn._tandem_prefill = prefill
    return fn


def load_cpu_prefill_attention() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The prefill entry point of :func:`load_cpu_attention`'s build, or ``None``."""
    return getattr(load_cpu_attention(), "_tandem_prefill", None)


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The caches' dtype code, once q is float32, the caches share a dtype the kernels read, hold
    q's head size (a ``q8_0`` row: its bytes) and every head dimension is contiguous (a
    ValueError otherwise)."""
    if q.dtype != torch.float32 or q.stride(-1) != 1:
        raise ValueError("q must be float32 with a contiguous head dimension")
    if k_cache.dtype not in KV_DTYPE_CODES or v_cache.dtype != k_cache.dtype:
        raise ValueError("the caches must both be float32, bfloat16, float16 or q8_0 (uint8)")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' head dimension must be contiguous")
    head_dim = q.shape[-1]
    row = kv_quant.row_bytes(head_dim) if k_cache.dtype == torch.uint8 else head_dim
    if k_cache.shape[-1] != row or v_cache.shape[-1] != row:
        raise ValueError(f"the caches' rows must be {row} wide for head_dim {head_dim}")
    return KV_DTYPE_CODES[k_cache.dtype]


def _options(window: int | None, softcap: float | None) -> tuple[int, float]:
    """``window`` and ``softcap`` as the C kernels take them (0: off)."""
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    return window or 0, softcap or 0.0


def cpu_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q ``[B, H, D]`` float32, caches ``[NB, BS, KVH, D]`` (float32, bfloat16 or float16;
    ``q8_0``: uint8 ``[NB, BS, KVH, row_bytes(D)]``; strided views; rows contiguous), int64 ``block_tables [B, max_blocks]`` and ``context_lens [B]``
    → ``[B, H, D]`` float32. ``window``/``softcap``: as :meth:`PagedAttention.forward` takes them.

    ``new_kv`` = (k and v ``[B, KVH, D]`` float32 with D contiguous, int64 slot blocks ``[B]``,
    slot offsets ``[B]``): write this step's K/V into the cache first (rounded to its dtype), in
    the same call."""
    fn = load_cpu_attention()
    if fn is None:
        raise RuntimeError("the CPU decode-attention kernel is not available")
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    code = _check_inputs(q, k_cache, v_cache)
    window_, softcap_ = _options(window, softcap)
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
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), code,
        tables.data_ptr(), tables.stride(0), lens.data_ptr(), out.data_ptr(),
        batch, heads, kv_heads, head_dim, block_size,
        scale, window_, softcap_, torch.get_num_threads(), *store,
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
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a prefill step's queries over the paged cache, which already holds
    the step's K/V: q ``[T, H, D]`` float32 (strided; D contiguous; sequence after sequence,
    ``query_lens`` rows each, at the last positions of its ``context_lens``), caches
    ``[NB, BS, KVH, D]`` (float32, bfloat16 or float16, or ``q8_0`` rows), int64 ``block_tables [B, max_blocks]`` →
    ``[T, H, D]`` float32. ``window``/``softcap``: as :meth:`PagedAttention.forward` takes them."""
    fn = load_cpu_prefill_attention()
    if fn is None:
        raise RuntimeError("the CPU prefill-attention kernel is not available")
    tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    code = _check_inputs(q, k_cache, v_cache)
    window_, softcap_ = _options(window, softcap)
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
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), code,
        tables.data_ptr(), tables.stride(0), lens[0].data_ptr(), lens[1].data_ptr(),
        out.data_ptr(), len(query_lens), heads, kv_heads, head_dim,
        block_size, scale, window_, softcap_, torch.get_num_threads(),
    )  # fmt: skip
    return out


def auto_cache_dtype() -> torch.dtype:
    """The cache dtype ``--kv-cache-dtype auto`` means for a float32 model on this CPU
    (:data:`AUTO_CACHE_DTYPES` for the selected instruction set; float32 without the kernels)."""
    if load_cpu_attention() is None:
        return torch.float32
    return AUTO_CACHE_DTYPES.get(vector_isa(selected_isa()), torch.float32)


def _int64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


class CpuPagedAttention(TorchPagedAttention):
    """Float32 queries through the C kernels (built at the first step) over a float32, bfloat16,
    float16 or ``q8_0`` cache; the rest, and everything when the kernels can't be built here, through the
    torch reference."""

    # The kernels are not timed against the torch reference: one numeric definition per
    # position needs the prefill kernel for every prompt row and the decode kernel, which
    # computes a row with the prefill's arithmetic, for every generated one (see the C file);
    # a reference path chosen by speed for some batch sizes would change a row's bits.

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
        """A decode step the kernel takes stores K/V and attends in one call; a prefill step
        stores them, then its prompts attend through the prefill kernel and its one-token rows
        (a mixed step) through the decode kernel, where each takes them."""
        kernel = load_cpu_attention() is not None
        if q.dtype != torch.float32 or k_cache.dtype not in KV_DTYPE_CODES or not kernel:
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
        if not meta.is_prefill:
            return cpu_paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.decode_context_lens(), scale,
                new_kv=(k, v, meta.slot_blocks, meta.slot_offsets), window=window, softcap=softcap,
            )  # fmt: skip
        self.store_kv(k, v, k_cache, v_cache, meta)
        if not meta.is_prefill:
            return self._decode(q, k_cache, v_cache, meta, scale, window, softcap)
        split = meta.mixed
        if split is None:
            return self._prefill(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
        out = torch.empty_like(q)  # K/V of every row are stored: the halves only read the cache
        out[split.decode_rows] = self._decode(q[split.decode_rows], k_cache, v_cache, split.decode,
                                              scale, window, softcap)  # fmt: skip
        if split.prefill is not None:
            rows = split.prefill_rows
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, split.prefill,
                                      scale, window, softcap)  # fmt: skip
        return out

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
        return self._prefill(q, k, v, k_cache, v_cache, meta, scale, None, None)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return self._decode(q, k_cache, v_cache, meta, scale, None, None)

    def native_decode(self, batch: int) -> bool:
        return load_cpu_attention() is not None

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        special = window is not None or softcap is not None
        if (
            q.dtype == torch.float32
            and k_cache.dtype in KV_DTYPE_CODES
            and q.shape[-1] % KERNEL_HEAD_DIM_MULTIPLE == 0
            and load_cpu_prefill_attention() is not None
        ):
            return cpu_paged_prefill_attention(q, k_cache, v_cache, meta.block_tables,
                                               meta.context_lens, meta.query_lens, scale, window,
                                               softcap)  # fmt: skip
        if special:
            return _windowed_forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
        return super().prefill(q, k, v, k_cache, v_cache, meta, scale)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        special = window is not None or softcap is not None
        if (
            q.dtype == torch.float32
            and k_cache.dtype in KV_DTYPE_CODES
            and load_cpu_attention() is not None
        ):
            return cpu_paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                              meta.decode_context_lens(), scale, window=window,
                                              softcap=softcap)  # fmt: skip
        if special:  # the reference reads only the cache: q stands in for the stored k and v
            return _windowed_forward(q, q, q, k_cache, v_cache, meta, scale, window, softcap)
        return super().decode(q, k_cache, v_cache, meta, scale)
