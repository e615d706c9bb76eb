"""Token embedding that can hold its table quantized (GGUF's ``token_embd`` is often Q8_0).

A lookup only needs the rows of the step's tokens, so a quantized table is dequantized row by row
(:meth:`QuantizedWeight.rows`) and never expanded whole. With tied embeddings the LM head is
loaded from the same quantized weight; once the head is tiled for the CPU kernel,
:meth:`Embedding.read_from` makes the lookup read the head's tiles and drops the table, so the
weight is held once. An untied table on CPU is tiled itself (:meth:`Embedding.read_tiles`): the
C kernel expands a step's rows in microseconds, where the row path's PyTorch ops took a third of a
millisecond of every decode step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.core.kernels.cpu_qgemv import CpuQGemv
from services.engine.core.quant.quantized_weight import QuantizedWeight


class Embedding(nn.Embedding):
    """``nn.Embedding`` plus an optional quantized table (:meth:`set_quantized`)."""

    quant: QuantizedWeight | None
    rows_from: Callable[[torch.Tensor], torch.Tensor] | None

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.quant = self.rows_from = None

    def read_from(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Look rows up through ``rows`` (e.g. a tied head's tiles) and drop the own table."""
        self.rows_from, self.quant = rows, None

    def read_tiles(self, kernel: CpuQGemv) -> bool:
        """Hold the quantized table as ``kernel``'s tiles (the same bytes) and look rows up there:
        the same values as :meth:`QuantizedWeight.rows`. False, nothing changed, where there is no
        quantized table or the kernel has no tiles for its format."""
        quant = self.quant
        if quant is None:
            return False
        fmt = kernel.tile_format(quant)
        if fmt not in kernel.block_bytes or quant.shape[1] % kernel.block_inputs[fmt]:
            return False
        packed, vocab = kernel.tile_weight(quant, fmt), self.num_embeddings
        self.read_from(lambda index: kernel.gather_rows(packed, fmt, index, vocab))
        return True

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Hold the table quantized; the float ``weight`` parameter is emptied."""
        weight.require_shape((self.num_embeddings, self.embedding_dim), "an embedding")
        self.quant = weight
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.rows_from is not None:
            return self.rows_from(input_ids)
        if self.quant is not None:
            return self.quant.rows(input_ids)
        return F.embedding(input_ids, self.weight)
