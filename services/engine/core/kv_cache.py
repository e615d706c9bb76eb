"""The paged KV pool: one torch tensor holding every block of every layer.

Layout (one row per block; a block is the unit of the prefill→decode hand-off)::

    data[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]
          └─ block b = data[b] is ONE contiguous region: all layers' K and V for its slots

Layer ``l`` sees strided views ``data[:, l, 0]`` (K) and ``data[:, l, 1]`` (V) of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; attention indexes them with block tables.
Which blocks belong to whom is the pure-Python :class:`BlockManager`'s business, not this file's.

The pool's dtype is the model's compute dtype, or a 16-bit one under a float32 model
(``--kv-cache-dtype``, :func:`kv_cache_dtype`): K/V are rounded to it as they are stored and
widened back as attention reads them, for half the memory per token and half the bytes per
hand-off. A block's bytes are the pool's own, whatever its dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgumentError

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def kv_cache_dtype(
    requested: str | None,
    compute: torch.dtype,
    auto: Callable[[], torch.dtype] | None = None,
) -> torch.dtype:
    """The pool dtype ``--kv-cache-dtype requested`` means for a model computing in ``compute``.

    None is the compute dtype (the parity reference). ``auto`` is ``auto()`` where the caller
    gives one (the CPU attention backend's choice for a float32 model), else the compute dtype. A
    named dtype is the compute dtype, or a 16-bit one under a float32 model; a cache wider than
    the model computes, or another 16-bit type than the model's, is refused
    (InvalidArgumentError).
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
    dtype: str

    @property
    def block_numel(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


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
        self.data = torch.zeros(
            num_blocks,
            layout.num_layers,
            2,
            layout.block_size,
            layout.num_kv_heads,
            layout.head_dim,
            dtype=getattr(torch, layout.dtype),
            device=device,
        )
        # K and V views per layer, made once: every step of every layer asks for them
        self._layers = [(self.data[:, i, 0], self.data[:, i, 1]) for i in range(layout.num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of one layer, each ``[num_blocks, block_size, kv_heads, head_dim]``."""
        return self._layers[index]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of the given blocks, ``[len(block_ids), *block_shape]``."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        return self.data.index_select(0, index)

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Copy ``blocks`` (``[len(block_ids), *block_shape]``) into the given block slots."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        self.data.index_copy_(0, index, blocks.to(self.data.device, self.data.dtype))

    def block_view(self, block_id: int) -> torch.Tensor:
        """The storage of one block (contiguous), for zero-copy byte access."""
        return self.data[block_id]
