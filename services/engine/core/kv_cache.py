"""The paged KV pool: one torch tensor holding every block of every layer.

Layout (one row per block; a block is the unit of the prefill→decode hand-off)::

    data[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, row]
          └─ block b = data[b] is ONE contiguous region: all layers' K and V for its slots

Layer ``l`` sees strided views ``data[:, l, 0]`` (K) and ``data[:, l, 1]`` (V) of shape
``[num_blocks, block_size, num_kv_heads, row]``; attention indexes them with block tables.
Which blocks belong to whom is the pure-Python :class:`BlockManager`'s business, not this file's.

The pool's dtype is the model's compute dtype, or under a float32 model on CPU a 16-bit one or
``q8_0``, or on CUDA ``fp8`` (``--kv-cache-dtype``, :func:`kv_cache_dtype`): K/V are rounded to it
as they are stored and widened back as attention reads them, for less memory per token and fewer
bytes per hand-off. ``fp8`` is float8 e4m3 (``torch.float8_e4m3fn``, the pool's own dtype, named so
in the layout) with a per-tensor scale of 1: values saturate at +-448, and the 3-bit mantissa keeps
about two significant digits (vLLM's ``--kv-cache-dtype fp8`` without calibrated scales does the
same). Why no scale: K/V come one token at a time, so a scale fixed before the first store would be
a guess or a calibration pass; a model whose K/V pass +-448 loses those values' size
(``kv_quant.FP8_MAX`` is where a calibrated scale would enter), and the agreement with 16-bit KV
measured in docs/benchmarks.md is the check. A float pool's ``row`` is ``head_dim`` elements of its
dtype. A ``q8_0`` pool is uint8 and its ``row`` is one (slot, KV head)'s ``head_dim`` int8 quants
followed by their float16 scales, one per 32 values (``kv_quant.py``; llama.cpp's ``q8_0``
arithmetic): 68 bytes for a 64-wide head where float16 takes 128, 136 for 128 (256). Why the scales
sit at the end of each row rather than in llama.cpp's interleaved 34-byte blocks, or grouped per
block: the attention kernels walk a row's values in whole vectors, and the quants of one row stay
one contiguous run (a vector never straddles a scale), while a row's scales are one cache line away
at most; a row is still a slot's whole state, so a block remains one contiguous region and the
hand-off copies it as bytes, as for any dtype. A block's bytes are the pool's own, whatever its
dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgumentError
from services.engine.core import kv_quant
from services.engine.core.kernels.huge_pages import huge_page_arena

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "q8_0", "fp8")
Q8_0 = "q8_0"  # the quantized cache: uint8 storage (see the module docstring)
FP8 = "fp8"  # the CUDA 8-bit cache: a torch.float8_e4m3fn pool (see the module docstring)
# what a cache dtype is: a torch float dtype, or Q8_0
KVDtype = torch.dtype | str


def kv_cache_dtype(
    requested: str | None,
    compute: torch.dtype,
    auto: Callable[[], torch.dtype] | None = None,
    device_type: str = "cpu",
) -> KVDtype:
    """The pool dtype ``--kv-cache-dtype requested`` means for a model computing in ``compute``
    on ``device_type``.

    None is the compute dtype (the parity reference). ``auto`` is ``auto()`` where the caller
    gives one (the CPU attention backend's choice for a float32 model), else the compute dtype. A
    named dtype is the compute dtype, or a 16-bit one under a float32 model; a cache wider than
    the model computes, or another 16-bit type than the model's, is refused
    (InvalidArgumentError). ``q8_0`` (returned as :data:`Q8_0`) is for float32 models on CPU,
    refused elsewhere; ``fp8`` (``torch.float8_e4m3fn``) is for any model on CUDA, refused on
    CPU (its kernels are the Triton ones; ``q8_0`` is the CPU's 8-bit cache).
    """
    if requested is None:
        return compute
    if requested not in KV_CACHE_DTYPES:
        raise InvalidArgumentError(
            f"unknown KV cache dtype {requested!r}; choose one of {', '.join(KV_CACHE_DTYPES)}",
            param="kv_cache_dtype",
        )
    if requested == "auto":
        return auto() if auto is not None else compute
    if requested == Q8_0:
        if device_type != "cpu":
            raise InvalidArgumentError(
                f"--kv-cache-dtype q8_0 runs on CPU only, not {device_type} (its attention "
                "kernels are the CPU ones); use float16 or bfloat16 there",
                param="kv_cache_dtype",
            )
        if compute != torch.float32:
            compute_name = str(compute).removeprefix("torch.")
            raise InvalidArgumentError(
                f"--kv-cache-dtype q8_0 with a model that computes in {compute_name}: a q8_0 "
                "cache is for float32-activation models (every CPU dtype but bfloat16/float16)",
                param="kv_cache_dtype",
            )
        return Q8_0
    if requested == FP8:
        if device_type != "cuda":
            raise InvalidArgumentError(
                f"--kv-cache-dtype fp8 runs on CUDA only, not {device_type} (its kernels are the "
                "Triton ones); on CPU use q8_0",
                param="kv_cache_dtype",
            )
        return torch.float8_e4m3fn
    dtype = getattr(torch, requested)
    if dtype != compute and compute != torch.float32:
        compute_name = str(compute).removeprefix("torch.")
        raise InvalidArgumentError(
            f"--kv-cache-dtype {requested} with a model that computes in {compute_name}: the "
            f"cache holds the model's dtype ({compute_name}), or a 16-bit one under float32",
            param="kv_cache_dtype",
        )
    return dtype


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a peer must agree on before KV bytes can be copied between pools."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a torch float dtype's name ("float8_e4m3fn" for fp8), or "q8_0"

    @property
    def storage_dtype(self) -> torch.dtype:
        """The pool tensor's dtype: uint8 for ``q8_0``, else :attr:`dtype` itself."""
        return torch.uint8 if self.dtype == Q8_0 else getattr(torch, self.dtype)

    @property
    def row(self) -> int:
        """Elements of :attr:`storage_dtype` per (slot, KV head): ``head_dim``, or a ``q8_0``
        row's bytes (quants and scales)."""
        return kv_quant.row_bytes(self.head_dim) if self.dtype == Q8_0 else self.head_dim

    @property
    def block_numel(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.row

    @property
    def block_bytes(self) -> int:
        return self.block_numel * torch.empty((), dtype=self.storage_dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes, every layer's K and V."""
        return self.block_bytes // self.block_size


class KVPool:
    """Owns the KV tensor; reads and writes whole blocks for transfers."""

    def __init__(
        self,
        num_blocks: int,
        layout: KVLayout,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads,
                 layout.row)  # fmt: skip
        # on CPU in huge pages where the system gives them (decode attention streams the pool);
        # zeroed now either way, every page touched: a pool too big for memory fails at start
        arena = huge_page_arena() if torch.device(device).type == "cpu" else None
        if arena is not None:
            self.data = arena.empty(shape, layout.storage_dtype).zero_()
        else:
            self.data = torch.zeros(shape, dtype=layout.storage_dtype, device=device)
        # K and V views per layer, made once: every step of every layer asks for them
        self._layers = [(self.data[:, i, 0], self.data[:, i, 1]) for i in range(layout.num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of one layer, each ``[num_blocks, block_size, kv_heads, row]``."""
        return self._layers[index]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of the given blocks, ``[len(block_ids), *block_shape]`` (gathered as
        bytes, as :meth:`write_blocks` writes them)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        return self.data.view(torch.uint8).index_select(0, index).view(self.data.dtype)

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Copy ``blocks`` (``[len(block_ids), *block_shape]``) into the given block slots (as
        bytes: PyTorch has no ``index_copy_`` for float8)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        source = blocks.to(self.data.device, self.data.dtype).view(torch.uint8)
        self.data.view(torch.uint8).index_copy_(0, index, source)

    def block_view(self, block_id: int) -> torch.Tensor:
        """The storage of one block (contiguous), for zero-copy byte access."""
        return self.data[block_id]
