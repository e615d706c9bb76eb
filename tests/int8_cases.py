"""Weights and rows for the int8 kernels' tests (``tests/test_int8_decode.py`` on this machine's
builds, ``tests/test_arm_kernels.py`` on aarch64 builds under emulation): valid blocks of every
format the decode rows read, their largest values, rows with groups of every size, and the float64
reference of the kernels' int8 math."""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from services.engine.core.kernels import cpu_q4a8_gemm, cpu_qgemv
from services.engine.core.kernels.cpu_q4a8_gemm import CpuQ4A8Gemm
from services.engine.core.kernels.cpu_qgemv import CpuQGemv
from services.engine.core.kernels.native_build import load_library
from services.engine.core.quant.quantized_weight import QuantizedWeight, from_gguf_blocks

TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
F16_OFFSETS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # byte offsets of d (and dmin)
OUT, IN = 70, 512  # a partial last tile for every width; 2 super-blocks, 16 groups of 32


def quant_weight(ggml_type: T, seed: int = 0, out: int = OUT, n_in: int = IN) -> QuantizedWeight:
    """Valid blocks: gguf's own quantizer where it has one, else random bytes with moderate
    float16 super-block scales."""
    rng = np.random.default_rng(seed)
    if ggml_type not in F16_OFFSETS:
        weight = rng.standard_normal((out, n_in)).astype(np.float32) * 0.05
        weight[3, 64:96] = 0.0  # an all-zero group
        raw = quantize(weight, ggml_type)
    else:
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n = out * n_in // block_size
        blocks = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
        for offset in F16_OFFSETS[ggml_type]:
            d = (rng.random(n) * 2e-3 - 1e-3).astype(np.float16)
            blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(n, 2)
        raw = blocks.reshape(out, -1)
    weight = from_gguf_blocks(raw, ggml_type, (out, n_in))
    assert weight is not None
    return weight


def extreme_weight(ggml_type: T) -> QuantizedWeight:
    """Every quant at its format's largest value (all bits set: 15, 31 or 63, the 16-bit sums'
    worst case), moderate float16 scales."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n = OUT * IN // block_size
    blocks = np.full((n, type_size), 0xFF, dtype=np.uint8)
    for offset in F16_OFFSETS[ggml_type]:
        blocks[:, offset : offset + 2] = np.full(n, 1e-3, np.float16).view(np.uint8).reshape(n, 2)
    weight = from_gguf_blocks(blocks.reshape(OUT, -1), ggml_type, (OUT, IN))
    assert weight is not None
    return weight


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel rounds it, in float64: per row and group of 32, ``round_half_even(x *
    (127 / max|x|)) * (max|x| / 127)`` (127 / max a float32 division; an all-zero group stays 0)."""
    rows, inputs = x.shape
    groups = x.reshape(rows, inputs // 32, 32)
    peak = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(peak > 0, torch.full_like(peak, 127.0) / peak, torch.zeros_like(peak))
    return (torch.round(groups * inverse).double() * (peak.double() / 127)).reshape(rows, inputs)


def reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 of the kernel's math: the int8-rounded rows times the exactly dequantized weight."""
    y = rounded_rows(x) @ weight.dequantize().double().T
    return y if bias is None else y + bias.double()


def int8_rows(rows: int, seed: int = 0, n_in: int = IN) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_in, generator=gen) * torch.logspace(-2, 1, n_in)  # groups of all sizes
    x[0, :32] = 0.0  # an all-zero group (d = 0)
    return x


@functools.cache
def int8_kernels(isa: str) -> tuple[CpuQGemv, CpuQ4A8Gemm]:
    """This machine's ``isa`` builds of the tiles' kernel and the int8 kernels, loaded once."""
    return (
        CpuQGemv(load_library(cpu_qgemv.SOURCE, isa)),
        CpuQ4A8Gemm(load_library(cpu_q4a8_gemm.SOURCE, isa)),
    )


# row ranges of twin_inputs' 40 rows that take every row path (one row, register blocks, group
# by group, the panel), the extreme rows included
TWIN_RANGES = ((0, 1), (5, 6), (0, 3), (5, 12), (0, 9), (0, 17), (0, 40))


def twin_inputs(ggml_type: T) -> tuple[list[QuantizedWeight], torch.Tensor]:
    """What two builds that must agree bit for bit are run on: a random weight (and, for the K
    formats, one at its largest values) and 40 rows, rows 5-11 rounding every input to +-127 (with
    the largest quants, the 16-bit sums' worst case)."""
    weights = [quant_weight(ggml_type, seed=11)]
    if ggml_type in F16_OFFSETS:
        weights.append(extreme_weight(ggml_type))
    x = int8_rows(40, seed=13)
    x[5:9] = 1.0
    x[9:12] = -1.0
    return weights, x

