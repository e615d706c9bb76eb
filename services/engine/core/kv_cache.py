"""The paged KV pool: one torch tensor holding every block of every layer.

Layout (one row per block; a block is the unit of the prefill→decode hand-off)::

    data[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]
          └─ block b = data[b] is ONE contiguous region: all layers' K and V for its slots

Layer ``l`` sees strided views ``data[:, l, 0]`` (K) and ``data[:, l, 1]`` (V) of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; attention indexes them with block tables.
Which blocks belong to whom is the pure-Python :class:`BlockManager`'s business, not this file's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
