"""Python side of ``cpu_decode_layers.c``: all decoder layers of a float32 decode step in one call
(over a float32, bfloat16 or float16 KV cache; ``q4_a8``'s projections over int8 activations), for
Llama-shaped layers and Qwen3's (per-head q/k norms) and Gemma 2 / 3's (sandwich norms, GeGLU,
sliding windows with their own rope tables, score soft-cap).

The model hands :meth:`CpuDecodeLayers.bind` its layers' weights once (the kernels' tiles, the
norm weights) as plain descriptors — this module knows tensors, not ``nn.Module`` — and gets back a
:class:`DecodeLayersCall` whose pointer arrays are built once; per step it passes only the
residual stream, the rows' positions (the C call reads the rotary tables itself), the step's
attention metadata and the final norm's weights. The result is the same bits
as the per-op kernel path (the C file is a unity build of those kernels, chained in the same
order); the model still decides per batch size whether to use it (see
:meth:`~services.engine.core.models.base.CausalLM.use_decode_layers`).

:func:`load_cpu_decode_layers` builds it once per process for the selected instruction set, or
returns ``None`` (one log line saying why); ``TANDEM_CPU_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import operator
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.core.kernels import prefetch_tuning
from services.engine.core.kernels.cpu_paged_attention import KV_DTYPE_CODES
from services.engine.core.kernels.cpu_q4a8_gemm import DECODE_FORMATS
from services.engine.core.kernels.cpu_qgemv import FORMAT_CODES
from services.engine.core.kernels.native_build import load_kernel

SOURCE = Path(__file__).with_name("cpu_decode_layers.c")
FLOAT32_CODE = -1  # FORMAT_FLOAT32 in the C file: cpu_gemv.c's float32 tiles
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class _Linear(ctypes.Structure):
    _fields_ = [("format", _I64), ("weight", _PTR), ("bias", _PTR), ("in_", _I64), ("out", _I64),
                ("int8", _I64)]  # fmt: skip


MAX_PARTS = 3  # MAX_PARTS in the C file: runs of one format a projection may come in (q, k, v)


class _Projection(ctypes.Structure):
    _fields_ = [("parts", _I64), ("part", _Linear * MAX_PARTS)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _PTR), ("post_norm", _PTR), ("attn_out_norm", _PTR),
        ("mlp_out_norm", _PTR), ("q_norm", _PTR), ("k_norm", _PTR),
        ("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection),
        ("down", _Projection),
        ("k_cache", _PTR), ("v_cache", _PTR), ("window", _I64), ("local_rope", _I64),
        ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
    ]  # fmt: skip


class _Shape(ctypes.Structure):
    _fields_ = [
        *((name, _I64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                     "block_size", "k_sb", "k_ss", "k_sh", "v_sb", "v_ss", "v_sh",
                                     "kv_dtype", "act")),
        ("eps", ctypes.c_float),
    ]  # fmt: skip


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # ACT_SILU, ACT_GELU_TANH in the C file


@dataclass(frozen=True, slots=True)
class LinearTiles:
    """One projection as a kernel reads it: ``format`` is ``"float32"`` (cpu_gemv tiles) or a
    quantized format (cpu_qgemv tiles); ``bias`` is padded to whole tiles, or ``None``;
    ``int8_activations``: its rows are rounded to int8 (``cpu_q4a8_gemm.c``'s decode kernel)."""

    format: str
    packed: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    int8_activations: bool = False


# a projection as the layers read it: its parts' tiles in output order (a fused projection whose
# parts a file stores in different formats has one per run of same-format rows), or one's
Projection = tuple[LinearTiles, ...] | LinearTiles


def _parts(projection: Projection) -> tuple[LinearTiles, ...]:
    return projection if isinstance(projection, tuple) else (projection,)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One layer as the C step reads it. Norm weights are what the RMSNorm kernel multiplies by
    (Gemma's ``1 + w``); each projection is one :class:`LinearTiles` or a tuple of its parts'
    side by side in output order. ``input_norm`` before attention, ``post_norm`` before the MLP,
    ``attn_out_norm`` / ``mlp_out_norm`` on attention's / the MLP's output (Gemma), ``q_norm`` /
    ``k_norm`` on each q / k head before the rotation (Qwen3, Gemma 3). ``window``: the sliding
    window (``None``: global); ``local_rope``: rotate with the local tables; ``softcap``: the
    attention score soft-cap (``None``: none)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    scale: float
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int | None = None
    local_rope: bool = False
    softcap: float | None = None

    def norms(self) -> list[torch.Tensor]:
        """The norm weights it has."""
        return [n for n in (self.input_norm, self.post_norm, self.attn_out_norm,
                            self.mlp_out_norm, self.q_norm, self.k_norm) if n is not None]  # fmt: skip


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """What every layer shares; ``act``: the MLP's activation (``silu`` or ``gelu_tanh``)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    act: str = "silu"


class CpuDecodeLayers:
    """The loaded library; :meth:`bind` prepares one model's layers."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        self._fn = library.tandem_decode_layers
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [
            ctypes.POINTER(_Shape), ctypes.POINTER(_Layer), _I64, _PTR, _I64, _PTR, _PTR, _PTR,
            _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, ctypes.c_float, ctypes.c_int,
        ]  # fmt: skip
        isa = library.tandem_qgemv_isa  # the unity build carries cpu_qgemv.c's entry points
        isa.restype = ctypes.c_char_p
        self.isa: str = isa().decode()
        self.build = Path(str(library._name)).name  # the cached library's file name

    def bind(self, shape: DecodeShape, layers: list[LayerWeights]) -> DecodeLayersCall:
        if shape.act not in ACTIVATIONS:
            raise ValueError(f"no decode-layers kernel for the {shape.act} activation")
        for weights in layers:
            for projection in (weights.qkv, weights.o, weights.gate_up, weights.down):
                parts = _parts(projection)
                if not 1 <= len(parts) <= MAX_PARTS or len({t.in_features for t in parts}) != 1:
                    raise ValueError(f"a projection comes in 1 to {MAX_PARTS} parts of one input "
                                     f"size, not {[(t.out_features, t.in_features) for t in parts]}")
                for tiles in parts:
                    if tiles.format != "float32" and tiles.format not in FORMAT_CODES:
                        raise ValueError(f"no decode-layers kernel for {tiles.format} weights")
                    if tiles.int8_activations and tiles.format not in DECODE_FORMATS:
                        raise ValueError(
                            f"no int8-activation decode kernel for {tiles.format} weights")
            for norm in weights.norms():
                if norm.dtype != torch.float32 or not norm.is_contiguous():
                    raise ValueError("RMSNorm weights must be contiguous float32")
            if (weights.q_norm is None) != (weights.k_norm is None):
                raise ValueError("q and k head norms come together")
        return DecodeLayersCall(self._fn, shape, layers, self.isa, self.build)


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _linear(tiles: LinearTiles) -> _Linear:
    code = FLOAT32_CODE if tiles.format == "float32" else FORMAT_CODES[tiles.format]
    bias = None if tiles.bias is None else tiles.bias.data_ptr()
    return _Linear(code, tiles.packed.data_ptr(), bias, tiles.in_features, tiles.out_features,
                   int(tiles.int8_activations))


def _projection(projection: Projection) -> _Projection:
    parts = _parts(projection)
    entry = _Projection(len(parts))
    for index, tiles in enumerate(parts):
        entry.part[index] = _linear(tiles)
    return entry


class DecodeLayersCall:
    """Every layer of one model for decode batches, its weight pointers prepared once; the KV
    pool's per-layer views are set with :meth:`set_caches` (once per pool)."""

    def __init__(
        self,
        fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
        shape: DecodeShape,
        layers: list[LayerWeights],
        isa: str,
        build: str,
    ) -> None:
        self._fn, self._decode_shape = fn, shape
        self.isa, self.build = isa, build
        self._layers_py = layers  # kept alive: the array holds their pointers
        self._layers = (_Layer * len(layers))()
        for entry, weights in zip(self._layers, layers, strict=True):
            entry.input_norm = weights.input_norm.data_ptr()
            entry.post_norm = weights.post_norm.data_ptr()
            entry.attn_out_norm, entry.mlp_out_norm = (_ptr(weights.attn_out_norm),
                                                       _ptr(weights.mlp_out_norm))  # fmt: skip
            entry.q_norm, entry.k_norm = _ptr(weights.q_norm), _ptr(weights.k_norm)
            entry.window, entry.local_rope = weights.window or 0, int(weights.local_rope)
            entry.scale, entry.softcap = weights.scale, weights.softcap or 0.0
            entry.qkv, entry.o = _projection(weights.qkv), _projection(weights.o)
            entry.gate_up, entry.down = _projection(weights.gate_up), _projection(weights.down)
        self._shape: _Shape | None = None
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.caches_of: object = None  # the pool the caches were taken from (the caller's key)
        # the rotary tables last passed (cos, sin, local cos, local sin), their pointers and rows
        self._tables: tuple[torch.Tensor, ...] = ()
        self._table_ptrs: tuple[int, ...] = ()

    def tiles(self) -> list[LinearTiles]:
        """Every projection of every layer, in order (each part of one in parts)."""
        return [t for w in self._layers_py for p in (w.qkv, w.o, w.gate_up, w.down)
                for t in _parts(p)]  # fmt: skip

    def set_caches(self, caches: list[tuple[torch.Tensor, torch.Tensor]], owner: object) -> None:
        """Each layer's ``(k_cache, v_cache)`` ``[blocks, block_size, kv_heads, head_dim]`` views
        (float32, bfloat16 or float16, all one dtype; strides shared by every layer, head
        dimension contiguous), taken from ``owner``."""
        if len(caches) != len(self._layers):
            raise ValueError(f"{len(caches)} cache pairs for {len(self._layers)} layers")
        k0, v0 = caches[0]
        for k, v in caches:
            if (
                k.dtype not in KV_DTYPE_CODES or k.dtype != k0.dtype or v.dtype != k0.dtype
                or k.stride() != k0.stride() or v.stride() != v0.stride()
                or k.shape != k0.shape or v.shape != k0.shape or k.stride(-1) != 1 or v.stride(-1) != 1
            ):  # fmt: skip
                raise ValueError("KV caches must be float32 views (or bfloat16 or float16 ones) "
                                 "of one dtype, shape and layout")
        s = self._decode_shape
        self._shape = _Shape(
            s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, k0.shape[1],
            *k0.stride()[:3], *v0.stride()[:3], KV_DTYPE_CODES[k0.dtype], ACTIVATIONS[s.act], s.eps,
        )  # fmt: skip
        for entry, (k, v) in zip(self._layers, caches, strict=True):
            entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
        self._caches, self.caches_of = caches, owner

    def _set_tables(self, tables: tuple[torch.Tensor, ...]) -> None:
        width = self._decode_shape.head_dim
        if any(t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != width
               or not t.is_contiguous() for t in tables):  # fmt: skip
            raise ValueError(f"rotary tables must be contiguous float32 [positions, {width}]")
        self._tables = tables
        self._table_ptrs = (*(t.data_ptr() for t in tables), min(t.shape[0] for t in tables))

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
        local: tuple[torch.Tensor, torch.Tensor] | None = None,
        final_norm: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """Run every layer over ``x`` ``[rows, hidden]`` (contiguous float32, overwritten: returned
        as the stream leaving the last layer, normed by ``final_norm`` = ``(weight, eps)`` when
        given). ``positions``: each row's position (int64, contiguous), its row of the rotary
        tables ``rope`` = ``(cos, sin)``, contiguous float32 ``[positions, head_dim]`` (rope.py's
        whole tables, read here: no per-step gather), ``local`` the same for the layers bound with
        ``local_rope`` (default: ``rope``); the metadata tensors: int64, contiguous, one entry
        (tables: one row) per sequence."""
        if self._shape is None:
            raise RuntimeError("set_caches() before the first decode step")
        tables = (*rope, *(local if local is not None else rope))
        if not self._tables or not all(map(operator.is_, tables, self._tables)):
            # new tables (once per model): checked once, their pointers kept
            self._set_tables(tables)
        if positions.numel() != x.shape[0]:
            raise ValueError(f"{positions.numel()} positions for {x.shape[0]} rows")
        if positions.dtype != torch.long or not positions.is_contiguous():
            positions = positions.to(torch.long).contiguous()
        norm, eps = final_norm if final_norm is not None else (None, 0.0)
        status = self._fn(
            self._shape, self._layers, len(self._layers), x.data_ptr(), x.shape[0],
            positions.data_ptr(), *self._table_ptrs, block_tables.data_ptr(),
            block_tables.stride(0), context_lens.data_ptr(), slot_blocks.data_ptr(),
            slot_offsets.data_ptr(), _ptr(norm), eps, torch.get_num_threads(),
        )  # fmt: skip
        if status == -2:
            raise ValueError("a decode position is past the rotary tables")
        if status != 0:
            raise MemoryError("the CPU decode-layers kernel could not allocate its buffers")
        return x


@functools.cache
def load_cpu_decode_layers() -> CpuDecodeLayers | None:
    """The kernel, built for this machine, or ``None`` when it is off or can't be built here."""
    return load_kernel(
        SOURCE, lambda library: CpuDecodeLayers(prefetch_tuning.apply(library)),
        "CPU decode-layers kernel",
    )
