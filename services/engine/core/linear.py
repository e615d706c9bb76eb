"""A linear layer with CPU fast paths for decode and prefill, over float32 or quantized weights.

Batch-1 decode on CPU is weight streaming, and PyTorch's float32 ``F.linear`` for a handful of
rows runs a GEMV that reads the weight well below the socket's bandwidth. :meth:`Linear.pack`
lays the weight out once, after loading:

* With a native kernel (:mod:`services.engine.core.kernels.cpu_gemv` for float32,
  :mod:`services.engine.core.kernels.cpu_qgemv` for quantized weights) the weight becomes the
  kernel's tiles and the kernel computes the product; a row's result then does not depend on the
  other rows of the batch.
* Without one (no C compiler, not Linux, ``TANDEM_CPU_KERNELS=0``) a float32 weight becomes
  ``[S, in, W]``: ``S`` = thread count slices, one ``bmm`` giving each intra-op thread one slice.

One numeric definition per layer: a row's result depends on the row alone, never on how many
rows share the call, which step they came from, or whether they hold prompt or generated tokens.
So a prompt's KV is the same cold, chunked, after a prefix-cache hit, prefilled on another worker
or recomputed after a migration, and a generated token's KV equals what a later prompt that
contains it computes (docs/determinism.md). Concretely, a packed layer runs its native kernel
for every row count (the kernels compute each row alone); the autotune
(:class:`~services.engine.core.kernels.autotune.KernelRegimes`, measured at load by
:func:`pack_linears`) only decides whether a layer has a kernel at all (by its one-row regime,
where every kernel measured is several times faster than PyTorch), not per row count. A
float32 layer without a kernel takes ``F.linear`` (or the split ``bmm``), whose rows PyTorch's
BLAS does not promise to keep batch-invariant: such paths (no C compiler, CUDA) are outside the
guarantee. Keeping PyTorch's GEMM for prefill-sized calls of float-activation layers was faster
on some shapes; what dropping it costs is measured in docs/benchmarks.md.

A quantized layer (:meth:`Linear.set_quantized`) holds no float32 weight at all. Without a
kernel it dequantizes per call (slow, exact: the reference the kernels are tested against).

A fused projection whose parts a file stores in different formats (Q4_K ``q``/``k``, Q6_K ``v``)
keeps each as stored (:meth:`Linear.set_parts`): one child layer per run of same-format rows,
outputs side by side, where one matmul would need them re-quantized to a common, larger format.

With ``PackPlan.a8kernel`` (``--dtype q4_a8``: the 4-bit layers; ``q4_a8_decode``: every format
the int8 decode kernel reads) a layer rounds *every* row's activations to int8 per group of 32
(llama.cpp's scheme). Two kernels compute that, bit for bit the same per row (the same rounding,
exact integer sums, the same float chain per output): :mod:`services.engine.core.kernels.cpu_q4a8_gemm`'s
GEMM, which repacks a tile for many rows (4-bit formats only), and its decode kernel
(``tandem_a8_gemv``), for a few rows or formats the GEMM does not read. Which of the two runs is
a speed choice by row count (:data:`INT8_GEMM_MIN_ROWS`, and the GEMM is dropped where it measured
slower), never a numeric one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.core.kernels.autotune import MARGIN, REGIME_ROWS, KernelRegimes, choose_regimes
from services.engine.core.kernels.cpu_decode_layers import LinearTiles
from services.engine.core.kernels.cpu_gemv import CpuGemv, load_cpu_gemv
from services.engine.core.kernels.cpu_q4a8_gemm import DECODE_FORMATS as INT8_DECODE_FORMATS
from services.engine.core.kernels.cpu_q4a8_gemm import FORMATS as INT8_ACTIVATION_FORMATS
from services.engine.core.kernels.cpu_q4a8_gemm import CpuQ4A8Gemm, Q4A8Call, load_cpu_q4a8_gemm
from services.engine.core.kernels.cpu_qgemv import CpuQGemv, QGemvCall, load_cpu_qgemv
from services.engine.core.kernels.huge_pages import HugePageArena, huge_page_arena
from services.engine.core.quant.quantized_weight import QuantizedWeight

# rows from which an int8 layer's call takes the GEMM (when bound) rather than the decode kernel:
# the same bits either way; the decode kernel reads the weight as stored, the GEMM repacks each
# tile once per call, which pays for itself over a few register blocks of rows
INT8_GEMM_MIN_ROWS = 16

@dataclass(frozen=True, slots=True)
class PackPlan:
    """How :func:`pack_linears` lays out weights: ``kernel`` tiles (float32), ``qkernel`` tiles
    (quantized), ``splits`` bmm slices for float32 without a kernel; ``autotune`` measures the
    kernels against PyTorch on the model's shapes and keeps the faster path per row count;
    ``a8kernel`` (``q4_a8``) runs 4-bit layers over int8 activations, and with ``int8_decode``
    every layer whose format the int8 decode kernel reads (every row of each, either way);
    ``arena`` holds the kernels' tiles in huge pages (``None``: PyTorch's allocator)."""

    splits: int = 0
    kernel: CpuGemv | None = None
    qkernel: CpuQGemv | None = None
    autotune: bool = False
    a8kernel: CpuQ4A8Gemm | None = None
    int8_decode: bool = False
    arena: HugePageArena | None = None


class Linear(nn.Linear):
    """``nn.Linear`` plus optional packed layouts for CPU decode and quantized weights."""

    packed: torch.Tensor | None
    packed_bias: torch.Tensor | None
    kernel: CpuGemv | CpuQGemv | None
    quant: QuantizedWeight | None
    split: torch.Tensor | None
    regimes: KernelRegimes
    parts: nn.ModuleList | None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed = self.packed_bias = self.kernel = self.quant = self.split = None
        self.parts = None  # set_parts: one child layer per run of same-format rows
        self.regimes = KernelRegimes()  # kernel everywhere until pack_linears measures
        self._packed_format = ""
        self._qcall: QGemvCall | None = None
        self._a8call: Q4A8Call | None = None  # prompt tokens' rows over int8 (the GEMM)
        self._a8gemv: Q4A8Call | None = None  # generated tokens' rows over int8 (decode kernel)

    @property
    def weight_format(self) -> str:
        """The quantized format (``"q8_0"``, ``"q4"``, ``"q4_k"``, ...), else the float dtype's
        name."""
        if self.parts is not None:
            return "+".join(part.weight_format for part in self._children())
        if self.quant is not None:
            return self.quant.format
        return self._packed_format or str(self.weight.dtype).removeprefix("torch.")

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Hold ``weight`` quantized; the float32 ``weight`` parameter is emptied."""
        weight.require_shape((self.out_features, self.in_features), "a linear layer")
        self.quant = weight
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def set_parts(self, parts: list[QuantizedWeight]) -> None:
        """Hold a weight stored as row runs of different formats (``[out_i, in]`` each, in output
        order) as stored: one child layer per part, whose outputs this layer writes side by side.
        A child's bias is a view of its rows of this layer's bias, so a bias loaded before or
        after the weight reaches it."""
        if len(parts) < 2:
            raise ValueError("a layer in parts needs at least two of them")
        if sum(part.shape[0] for part in parts) != self.out_features:
            raise ValueError(f"parts of {[p.shape for p in parts]} do not fit a linear layer of "
                             f"shape {(self.out_features, self.in_features)}")  # fmt: skip
        children, start = [], 0
        for part in parts:
            rows = part.shape[0]
            with torch.device("meta"):
                child = Linear(self.in_features, rows, bias=False)
            child.set_quantized(part)
            if self.bias is not None:
                child.bias = nn.Parameter(self.bias.data[start : start + rows], requires_grad=False)
            children.append(child)
            start += rows
        self.parts = nn.ModuleList(children)
        self.quant = None
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def _children(self) -> list[Linear]:
        assert self.parts is not None
        return [child for child in self.parts if isinstance(child, Linear)]

    def pack(self, plan: PackPlan, *, free_dense: bool = False) -> None:
        """Build the kernel layout for this layer's weight, if ``plan`` has a kernel for it.

        Float32 weights with no kernel get the split-``bmm`` layout instead (``plan.splits``).
        With ``free_dense`` the ``[out, in]`` float weight is released afterwards (unless it is
        shared, e.g. a head tied to the embedding), so packing costs no extra memory.
        """
        if self.packed is not None or self.split is not None or self.parts is not None:
            return  # a layer in parts: its children are packed as layers of their own
        if self.quant is not None:
            if plan.qkernel is None:
                return  # the reference path: dequantize per call
            self.kernel = plan.qkernel  # the tiles' format: the quant's, or a compact variant
            self._packed_format = plan.qkernel.tile_format(self.quant)
            self.packed = _resident(plan, plan.qkernel.tile_weight(self.quant, self._packed_format))
            self.quant = None  # the tiles hold every bit of it (see CpuQGemv.untile)
            if self.bias is not None:
                self.packed_bias = plan.qkernel.tile_bias(self.bias.detach())
            self._qcall = plan.qkernel.bind(
                self.packed, self._packed_format, self.packed_bias, self.out_features
            )
            fmt = self._packed_format
            if plan.a8kernel is not None and fmt in INT8_DECODE_FORMATS and (
                plan.int8_decode or fmt in INT8_ACTIVATION_FORMATS
            ):  # int8 activations for every row of this layer
                self._a8gemv = plan.a8kernel.bind_decode(
                    self.packed, self.packed_bias, self.out_features, fmt
                )
                if fmt in INT8_ACTIVATION_FORMATS:
                    self._a8call = plan.a8kernel.bind(
                        self.packed, self.packed_bias, self.out_features, fmt
                    )
            return
        if self.weight.dtype != torch.float32:
            return
        if plan.kernel is not None:
            self.kernel, self._packed_format = plan.kernel, "float32"
            self.packed = _resident(plan, plan.kernel.tile_weight(self.weight.detach()))
            if self.bias is not None:
                self.packed_bias = plan.kernel.tile_bias(self.bias.detach())
        elif plan.splits >= 2:
            self.split = split_layout(self.weight.detach(), plan.splits)
        else:
            return
        if free_dense:
            self.free_dense()

    def add_split_layout(self, splits: int) -> None:
        """Also keep the split-``bmm`` layout (the float32 PyTorch path next to the kernel)."""
        if self.split is None and self.weight.numel() and splits >= 2:
            self.split = split_layout(self.weight.detach(), splits)

    def free_dense(self) -> None:
        """Release the ``[out, in]`` float weight when packed layouts serve every row count."""
        serves_all = self.split is not None or (
            self.packed is not None and self.regimes.use_kernel[0]
        )
        if serves_all and not getattr(self.weight, "_tandem_shared", False):
            self.weight.data = self.weight.data.new_empty(0)

    @property
    def int8_activations(self) -> bool:
        """Whether this layer rounds its rows' activations to int8 (every row, every call)."""
        return self._a8gemv is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is not None:
            return torch.cat([part(x) for part in self._children()], dim=-1)
        if self._a8gemv is not None and x.dim() == 2:
            if self._a8call is not None and x.shape[0] >= INT8_GEMM_MIN_ROWS:
                return self._a8call(x)
            return self._a8gemv(x)
        return self.float_forward(x)

    def float_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The float32-activation path: the kernel for every row count where the layer has one
        (its one-row regime measured it faster), else PyTorch."""
        if x.dim() != 2:
            return self.torch_forward(x)
        if self.packed is not None and self.regimes.use_kernel[0]:
            return self.kernel_forward(x)
        return self.torch_forward(x)

    def kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The native kernel over the packed tiles (``pack`` must have built them)."""
        if self._qcall is not None:
            return self._qcall(x)
        if self.kernel is None or self.packed is None:
            raise RuntimeError("kernel_forward on a layer that pack() gave no kernel")
        return self.kernel(x, self.packed, self.packed_bias, self.out_features)

    def int8_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The 8-bit-activation GEMM (``pack`` must have bound it)."""
        if self._a8call is None:
            raise RuntimeError("int8_forward on a layer without the 8-bit-activation GEMM")
        return self._a8call(x)

    def int8_decode_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The 8-bit-activation decode kernel (``pack`` must have bound it)."""
        if self._a8gemv is None:
            raise RuntimeError("int8_decode_forward on a layer without the int8 decode kernel")
        return self._a8gemv(x)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The PyTorch path: split ``bmm``, ``F.linear``, or dequantize-then-``F.linear``."""
        if self.split is not None and x.dim() == 2:
            return split_matmul(x, self.split, self.out_features, self.bias)
        if self.weight.numel():
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.dequantized_weight(), self.bias)

    def kernel_tiles(self, rows: int) -> tuple[LinearTiles, ...] | None:
        """This layer's kernel tiles, one per part in output order (one for a layer not in
        parts), when ``rows`` generated tokens' rows run a native kernel in every part (else
        ``None``): the int8-activation decode kernel's where it is bound."""
        if self.parts is not None:
            tiles = [child.kernel_tiles(rows) for child in self._children()]
            if any(t is None for t in tiles):
                return None
            return tuple(t for part in tiles if part is not None for t in part)
        if self.packed is None or self.kernel is None:
            return None
        if self._a8gemv is None and not self.regimes.use_kernel[0]:
            return None
        return (LinearTiles(self._packed_format, self.packed, self.packed_bias, self.in_features,
                            self.out_features, int8_activations=self._a8gemv is not None),)  # fmt: skip

    @property
    def has_quantized_tiles(self) -> bool:
        return isinstance(self.kernel, CpuQGemv) and self.packed is not None

    def gather_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the weight read from the quantized kernel tiles (a tied embedding's
        lookup); needs :attr:`has_quantized_tiles`."""
        if not isinstance(self.kernel, CpuQGemv) or self.packed is None:
            raise RuntimeError("gather_rows on a layer without quantized kernel tiles")
        return self.kernel.gather_rows(self.packed, self._packed_format, index, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight of a quantized or packed layer (built per call, not
        kept; for quantized tiles the C kernel dequantizes, transposed, for PyTorch's GEMM)."""
        if self.parts is not None:
            return torch.cat([child.dequantized_weight() for child in self._children()])
        if self.quant is not None:
            return self.quant.dequantize()
        if isinstance(self.kernel, CpuQGemv) and self.packed is not None:
            return self.kernel.dequantize_t(self.packed, self._packed_format, self.out_features).T
        if self.packed is not None and isinstance(self.kernel, CpuGemv):
            tiles, in_features, tile = self.packed.shape
            dense = self.packed.transpose(1, 2).reshape(tiles * tile, in_features)
            return dense[: self.out_features]
        if self.split is not None:
            splits, in_features, width = self.split.shape
            dense = self.split.transpose(1, 2).reshape(splits * width, in_features)
            return dense[: self.out_features]
        raise RuntimeError("this linear layer holds no weight")


def split_layout(weight: torch.Tensor, splits: int) -> torch.Tensor:
    """``[out, in]`` → ``[S, in, W]`` (``W`` = ceil(out / S)), the last slice padded with zeros."""
    out_features, in_features = weight.shape
    width = -(-out_features // splits)
    pad = width * splits - out_features
    if pad:
        weight = torch.cat([weight, weight.new_zeros(pad, in_features)])
    return weight.view(splits, width, in_features).transpose(1, 2).contiguous()


def split_matmul(
    x: torch.Tensor, split: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` over the split layout: one ``bmm`` slice per intra-op thread."""
    rows = x.shape[0]
    splits, _, width = split.shape
    out = torch.matmul(x, split)  # broadcasts x over the S slices: [S, rows, W]
    if rows == 1:
        out = out.view(1, splits * width)  # slice-major order is already the output order
    else:
        out = out.transpose(0, 1).reshape(rows, splits * width)
    if splits * width != out_features:
        out = out[:, :out_features]
    return out + bias if bias is not None else out


def _resident(plan: PackPlan, tiles: torch.Tensor) -> torch.Tensor:
    """Where a layer's tiles live for good: the plan's huge-page arena, when it has one (every
    decode step streams them: huge pages spare it a TLB miss per 4 KiB; see kernels/huge_pages.py)."""
    return tiles if plan.arena is None else plan.arena.copy(tiles)


def pack_linears(model: nn.Module, plan: PackPlan, *, free_dense: bool = False) -> int:
    """Pack every :class:`Linear` in ``model``; returns how many there are.

    With ``plan.autotune``, each kernel is then timed against its PyTorch path on the model's own
    layers (:func:`~services.engine.core.kernels.autotune.choose_regimes`), per weight format and
    shape, and every layer runs, per row count, whichever was faster for its shape; float32
    layers keep the split layout for the row counts where PyTorch won.

    Per shape, not per format: one decision for all of a format's layers was dominated by the
    largest one, the LM head (a third of a small model's weights, and the one layer that never
    sees a prompt's rows: it projects only the rows being sampled), which sent the decoder's
    prefill-sized matmuls to a kernel that was slower for them.
    """
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for layer in layers:
        layer.pack(plan)
    if plan.autotune:
        groups: dict[tuple[str, int, int], list[Linear]] = {}
        for layer in layers:
            if layer.packed is not None and not layer.regimes.measured:
                key = (layer.weight_format, layer.out_features, layer.in_features)
                groups.setdefault(key, []).append(layer)
        for (fmt, _, _), group in groups.items():
            _tune(fmt, group, plan, TUNE_BYTES // len(groups))
    if free_dense:
        for layer in layers:
            layer.free_dense()
    return len(layers)


TUNE_BYTES = 64 << 20  # weight bytes all timing runs read, at most (one layer a shape always)
# Per regime (1, 8, 32 rows, a 512-row prefill chunk): at decode sizes a tie goes to the kernel,
# which reads the compact weight and is what lets a whole decode step run as one C call (itself
# timed against the per-op path); one shape's per-op tie there measured 1.01x, and sending it to
# PyTorch cost the 32-row one-call path (-9% batch-32 decode). A prefill tie goes to PyTorch's
# GEMM, whose lead grows with the row count.
LINEAR_MARGINS = (0.0,) * (len(REGIME_ROWS) - 1) + (MARGIN,)  # the last regime is the prefill one
# without a measurement (none cached, busy, TANDEM_AUTOTUNE=fixed): what the measurements mostly
# chose (a float32 layer follows its 1-row choice at every row count: one numeric definition)
LINEAR_FIXED = (True,) * (len(REGIME_ROWS) - 1) + (False,)


def _tune(fmt: str, layers: list[Linear], plan: PackPlan, budget: int) -> None:
    """Time one group of same-format, same-shape layers: the first always, more while their
    weights fit in ``budget`` bytes (so the runs read weights from memory, as real steps do)."""
    kernel = layers[0].kernel
    if fmt == "float32":
        for layer in layers:  # the float32 PyTorch path is the split bmm (or F.linear)
            layer.add_split_layout(plan.splits)
    timed, total = [], 0
    for layer in layers:
        size = layer.packed.numel() * layer.packed.element_size() if layer.packed is not None else 0
        if not timed or total + size <= budget:
            timed.append(layer)
            total += size
    shape = f"{layers[0].out_features}x{layers[0].in_features}"
    regimes = choose_regimes(
        f"{fmt} {shape}",
        isa=getattr(kernel, "isa", "?"),
        build=getattr(kernel, "build", "?"),
        shapes=[(layer.out_features, layer.in_features) for layer in layers],
        run_kernel=_runner(timed, Linear.kernel_forward),
        run_torch=_runner(timed, Linear.torch_forward),
        margin=LINEAR_MARGINS,
        fixed=LINEAR_FIXED,
    )
    for layer in layers:
        layer.regimes = regimes
        if fmt == "float32" and regimes.use_kernel[0]:
            layer.split = None  # the kernel won everywhere: no second layout to keep
    if layers[0]._a8call is not None:
        gemm = choose_regimes(  # the same bits either way: only which is faster for a prompt
            f"{fmt} int8-activation gemm {shape}",
            isa=plan.a8kernel.isa if plan.a8kernel is not None else "?",
            build=plan.a8kernel.build if plan.a8kernel is not None else "?",
            shapes=[(layer.out_features, layer.in_features) for layer in layers],
            run_kernel=_runner(timed, Linear.int8_forward),
            run_torch=_runner(timed, Linear.int8_decode_forward),
            rows=REGIME_ROWS[-1:],
            fixed=True,
        )
        if not gemm.use_kernel[0]:
            for layer in layers:
                layer._a8call = None  # the decode kernel was faster even for a prompt here


def _runner(
    layers: list[Linear], path: Callable[[Linear, torch.Tensor], torch.Tensor]
) -> Callable[[int], None]:
    """Run every layer once on ``rows`` random rows (each reads its weight from memory)."""
    inputs: dict[tuple[int, int], torch.Tensor] = {}

    def run(rows: int) -> None:
        with torch.inference_mode():
            for layer in layers:
                key = (rows, layer.in_features)
                if key not in inputs:
                    inputs[key] = torch.randn(rows, layer.in_features)
                path(layer, inputs[key])

    return run


def pack_plan(
    device: torch.device,
    dtype: torch.dtype,
    *,
    autotune: bool = True,
    int8_activations: bool = False,
    int8_decode: bool = False,
) -> PackPlan | None:
    """The CPU fast paths for this device and activation dtype, or ``None`` to keep ``F.linear``;
    ``int8_activations`` rounds the 4-bit layers' activations to int8 (``q4_a8``), with
    ``int8_decode`` every layer the int8 decode kernel reads (``q4_a8_decode``)."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    threads = torch.get_num_threads()
    return PackPlan(
        splits=threads if threads >= 2 else 0,
        kernel=load_cpu_gemv(),
        qkernel=load_cpu_qgemv(),
        autotune=autotune,
        a8kernel=load_cpu_q4a8_gemm() if int8_activations else None,
        int8_decode=int8_activations and int8_decode,
        arena=huge_page_arena(),
    )
