"""A linear layer with CPU fast paths for memory-bound decode.

Batch-1 decode on CPU is weight streaming, and PyTorch's float32 ``F.linear`` for a handful of
rows runs a single-threaded GEMV that reads the weight at about one core's BLAS speed (~15 GB/s
here, of ~55 GB/s the socket can read). :meth:`Linear.pack` lays the weight out once, after
loading, as ``[S, in, W]``: ``S`` slices of ``W`` output features, each one contiguous run.

* With the native kernel (:mod:`services.engine.kernels.cpu_gemv`) the slices are its tiles
  (``W`` = 32) and every product goes through the kernel: it streams the weight on every core
  near the read bandwidth for decode, and on this AMD EPYC it also beats MKL's SGEMM for
  prefill-sized row counts (docs/benchmarks.md). A row's result then does not depend on the
  other rows of the batch.
* Without it (no C compiler, or not Linux) ``S`` is the thread count and one ``bmm`` gives each
  intra-op thread one slice (2.5× ``F.linear`` for SmolLM2 batch-1 decode on 2 cores).

The plain ``F.linear`` path is kept for GPUs and bfloat16 and is compared with both packed paths
in tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.kernels.cpu_gemv import CpuGemv, load_cpu_gemv


@dataclass(frozen=True, slots=True)
class PackPlan:
    """How :func:`pack_linears` lays out weights: ``kernel`` tiles, or ``splits`` bmm slices."""

    splits: int = 0
    kernel: CpuGemv | None = None


class Linear(nn.Linear):
    """``nn.Linear`` plus an optional packed ``[S, in, W]`` weight for CPU decode."""

    packed: torch.Tensor | None
    packed_bias: torch.Tensor | None
    kernel: CpuGemv | None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed = self.packed_bias = self.kernel = None

    def pack(self, plan: PackPlan, *, free_dense: bool = False) -> None:
        """Build the packed layout once (padding the last slice with zeros).

        With ``free_dense`` the ``[out, in]`` weight's storage is released afterwards (unless it
        is shared, e.g. a head tied to the embedding), so packing costs no extra memory.
        """
        if self.packed is not None or (plan.kernel is None and plan.splits < 2):
            return
        weight = self.weight.detach()
        if plan.kernel is not None:
            self.kernel = plan.kernel
            self.packed = plan.kernel.tile_weight(weight)
            if self.bias is not None:
                self.packed_bias = plan.kernel.tile_bias(self.bias.detach())
        else:
            width = -(-self.out_features // plan.splits)
            pad = width * plan.splits - self.out_features
            if pad:
                weight = torch.cat([weight, weight.new_zeros(pad, self.in_features)])
            self.packed = weight.view(plan.splits, width, self.in_features).transpose(1, 2).contiguous()
        if free_dense and not getattr(self.weight, "_tandem_shared", False):
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        if self.kernel is not None:
            return self.kernel(x, self.packed, self.packed_bias, self.out_features)
        rows = x.shape[0]
        splits, _, width = self.packed.shape
        out = torch.matmul(x, self.packed)  # broadcasts x over the S slices: [S, rows, W]
        if rows == 1:
            out = out.view(1, splits * width)  # slice-major order is already the output order
        else:
            out = out.transpose(0, 1).reshape(rows, splits * width)
        if splits * width != self.out_features:
            out = out[:, : self.out_features]
        return out + self.bias if self.bias is not None else out


def pack_linears(model: nn.Module, plan: PackPlan, *, free_dense: bool = False) -> int:
    """Pack every :class:`Linear` in ``model``; returns how many there are."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack(plan, free_dense=free_dense)
            count += 1
    return count


def pack_plan(device: torch.device, dtype: torch.dtype) -> PackPlan | None:
    """The CPU fast path for this device and dtype, or ``None`` to keep ``F.linear``."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    kernel = load_cpu_gemv()
    if kernel is not None:
        return PackPlan(kernel=kernel)
    threads = torch.get_num_threads()
    return PackPlan(splits=threads) if threads >= 2 else None
