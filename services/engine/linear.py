"""A linear layer with a CPU fast path for memory-bound decode.

On CPU, PyTorch's float32 ``F.linear`` for a handful of rows runs a GEMV that streams the weight
at about one core's bandwidth (measured ~15 GB/s here, out of ~40 GB/s for the socket). Splitting
the output features into ``S`` equal slices stored as ``[S, in, out/S]`` and calling one
``torch.bmm`` lets the intra-op thread pool take one slice each, which streams the weights at
close to full memory bandwidth (2.5× faster for SmolLM2 batch-1 decode on 2 cores; see
docs/benchmarks.md). :meth:`Linear.pack` builds that layout once after loading; the plain
``F.linear`` reference path is kept for GPUs and is compared with the packed one in tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """``nn.Linear`` plus an optional packed ``[S, in, out/S]`` weight for CPU decode."""

    packed: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed = None

    def pack(self, splits: int, *, free_dense: bool = False) -> None:
        """Build the split layout (padding the last slice) once.

        With ``free_dense`` the ``[out, in]`` weight's storage is released afterwards (unless it
        is shared, e.g. a head tied to the embedding), so packing costs no extra memory.
        """
        if splits < 2 or self.packed is not None:
            return
        width = -(-self.out_features // splits)
        weight = self.weight.detach()
        pad = width * splits - self.out_features
        if pad:
            weight = torch.cat([weight, weight.new_zeros(pad, self.in_features)])
        self.packed = weight.view(splits, width, self.in_features).transpose(1, 2).contiguous()
        if free_dense and not getattr(self.weight, "_tandem_shared", False):
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        splits, _, width = self.packed.shape
        rows = x.shape[0]
        out = torch.matmul(x, self.packed)  # broadcasts x over the S slices: [S, rows, W]
        if rows == 1:
            out = out.view(1, splits * width)  # slice-major order is already the output order
        else:
            out = out.transpose(0, 1).reshape(rows, splits * width)
        if splits * width != self.out_features:
            out = out[:, : self.out_features]
        return out + self.bias if self.bias is not None else out


def pack_linears(model: nn.Module, splits: int, *, free_dense: bool = False) -> int:
    """Pack every :class:`Linear` in ``model``; returns how many were packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack(splits, free_dense=free_dense)
            count += 1
    return count


def should_pack(device: torch.device, dtype: torch.dtype) -> int:
    """How many slices the CPU fast path should use here (0 = keep ``F.linear``)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or dtype != torch.float32 or threads < 2:
        return 0
    return threads
