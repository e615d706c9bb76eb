"""Weight loaders: ``load_model(name_or_path, dtype, device)`` for the default GGUF, a GGUF file,
a Hugging Face folder or ``dummy:<shape>``. Every failure is a one-line ModelLoadError.

Weight dtypes (``--dtype``):

* ``float32`` (the correctness reference);
* ``bfloat16``, ``float16``: on CUDA, the model in that precision. On CPU, weight-only: the
  matrices (and the embedding) held as 16-bit floats, half of float32's bytes per decode step,
  while activations, norms and the KV cache stay float32; the native kernel widens each weight
  exactly in registers. PyTorch's own bfloat16 matmuls were slower than float32 on every CPU
  measured, even with AVX512-BF16 (docs/benchmarks.md);
* ``q8_0``: 8-bit weights in groups of 32 (a GGUF's Q8_0 blocks as stored; any other weight,
  HF and float ones included, quantized to Q8_0 at load);
* ``q4``: a GGUF's blocks as stored — Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 (the name
  is older than the 5- and 6-bit kernels) — any other matrix as Q8_0; HF folders have no such
  blocks to keep, so ``q4`` needs a GGUF;
* ``q4_a8``: ``q4``'s weights, and every row of the 4-bit matrices rounds its activations to int8
  per group of 32, as llama.cpp does: integer multiply-adds, about twice the float32 rate on AVX2.
  It moves the logits by the activations' rounding (measured in docs/models.md), the trade llama.cpp
  makes for every matmul;
* ``q4_a8_decode``: ``q4_a8``, and every other quantized matrix's rows over int8 activations too
  (the int8 decode kernel): llama.cpp's trade for every matmul. Prompt and generated tokens' rows
  are rounded alike, so a position's numbers never depend on the path its request took
  (docs/determinism.md);
* ``auto`` (the CLI default): on CUDA bfloat16; on CPU, when the CPU kernel builds here for AVX2
  or AVX-512, the format the checkpoint already stores: ``q4_a8_decode`` for 4-bit GGUFs (``q4``
  when the 8-bit-activation kernel doesn't build), ``q4`` (as stored) for GGUFs of 5- and 6-bit blocks
  without 4-bit ones, ``q8_0`` for other quantized ones, ``bfloat16`` /
  ``float16`` (weight-only) for matrices stored in that 16-bit type (HF folders or GGUF), so no
  weight is rounded and none is widened in memory; float32
  otherwise (the ``generic`` build's 4-wide kernel measured slower than float32 PyTorch on x86,
  docs/benchmarks.md).

Quantized weights run on CPU only, with float32 activations (the ``q4_a8`` dtypes' int8 rows aside) and
KV cache, as the 16-bit float weights do on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from services.common.errors import ModelLoadError
from services.common.model_fingerprint import fingerprint, weights_digest
from services.common.model_source import ModelSource, resolve_model
from services.engine.core.attention_backends import make_attention_backend
from services.engine.core.loaders.dummy import dummy_config, iter_dummy_weights
from services.engine.core.loaders.gguf_file import (
    gguf_config,
    gguf_weight_types,
    iter_gguf_weights,
    open_gguf,
)
from services.engine.core.loaders.hf_folder import hf_weight_dtypes, iter_hf_weights, read_hf_config
from services.engine.core.loaders.weights import empty_model, load_weights
from services.engine.core.models import CausalLM
from services.common.model_config import ModelConfig
from services.engine.core.quant.quantized_weight import QuantizedWeight
from services.engine.core.tp_group import TensorParallelGroup

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HALF_DTYPES = ("bfloat16", "float16")
QUANT_DTYPES = ("q8_0", "q4")
# the weights each 8-bit-activation dtype holds (its prompt tokens' rows round x to int8)
INT8_ACTIVATION_DTYPES = {"q4_a8": "q4", "q4_a8_decode": "q4"}
INT8_DECODE_DTYPES = ("q4_a8_decode",)  # generated tokens' rows over int8 too
DTYPE_CHOICES = ("auto", *DTYPES, *QUANT_DTYPES, *INT8_ACTIVATION_DTYPES)
_FOUR_BIT_TYPES = {"Q4_0", "Q4_1", "Q4_K"}
_KEPT_TYPES = {"Q5_0", "Q5_1", "Q5_K", "Q6_K"}  # held as stored by ``q4`` too
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}
_HALF_TYPES = {"BF16": "bfloat16", "F16": "float16"}  # GGUF and safetensors spell them alike


class Sharding(Protocol):
    """How one tensor-parallel rank builds and fills its part of the model
    (``tp_shard.RankShard``): the shape it builds, the layers it switches before loading, and its
    slice of each weight as the checkpoint streams."""

    group: TensorParallelGroup

    def shard_config(self, config: ModelConfig) -> ModelConfig: ...
    def prepare(self, model: CausalLM) -> None: ...
    def shard_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], *,
        quantize: str | None = None,
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]: ...


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A ready model with its config and where it came from."""

    source: ModelSource
    config: ModelConfig
    model: CausalLM
    dtype: torch.dtype  # activations and KV cache
    weight_format: str = "float32"  # a name from DTYPE_CHOICES other than auto
    fingerprint: str = ""  # shape + weights' digest (services/common/model_fingerprint.py)
    # this rank's part of a tensor-parallel model (``model`` is then built with
    # ``sharding.shard_config(config)``; ``config`` stays the whole model's); None: width 1
    sharding: Sharding | None = None

    @property
    def int8_activations(self) -> bool:
        """Whether prompt tokens' matmul rows round their inputs to int8 (``q4_a8``)."""
        return self.weight_format in INT8_ACTIVATION_DTYPES

    @property
    def int8_decode(self) -> bool:
        """Whether generated tokens' rows round theirs too (``q4_a8_decode``, ``auto``'s pick for
        4-bit GGUFs: integer multiply-adds in decode steps, as llama.cpp)."""
        return self.weight_format in INT8_DECODE_DTYPES


def parse_dtype(name: str) -> str:
    """Check a ``--dtype`` name (see the module docstring); a ModelLoadError for anything else."""
    if name not in DTYPE_CHOICES:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of: {', '.join(DTYPE_CHOICES)}")
    return name


def resolve_dtype(name: str, source: ModelSource, device: str = "cpu") -> str:
    """The concrete dtype ``name`` means for ``source`` on ``device`` (``auto`` resolved)."""
    name = parse_dtype(name)
    kind = torch.device(device).type
    if name in INT8_ACTIVATION_DTYPES:
        resolve_dtype(INT8_ACTIVATION_DTYPES[name], source, device)  # the same weight checks
        return name
    if name in QUANT_DTYPES:
        if kind != "cpu":
            raise ModelLoadError(f"{name} weights run on CPU only, not {kind}")
        if name == "q4" and source.kind != "gguf":
            raise ModelLoadError(
                "q4 serves a GGUF's 4-bit weights as stored; this model has none (use q8_0)"
            )
    if name != "auto":
        return name
    if kind != "cpu":
        return "bfloat16"
    if source.kind == "gguf":
        types = gguf_weight_types(open_gguf(Path(source.path)))
    elif source.kind == "hf":
        types = hf_weight_dtypes(Path(source.path))
    else:
        return "float32"
    quantized = types - _FLOAT_TYPES
    half = {_HALF_TYPES[t] for t in types & set(_HALF_TYPES)}
    if not quantized and (len(half) != 1 or types - set(_HALF_TYPES)):
        return "float32"  # float32 matrices, or a mix that some 16-bit format would round
    from services.engine.core.kernels.cpu_qgemv import load_cpu_qgemv

    kernel = load_cpu_qgemv()
    if kernel is None or kernel.isa == "generic":
        return "float32"
    if quantized & _FOUR_BIT_TYPES:
        from services.engine.core.kernels.cpu_q4a8_gemm import load_cpu_q4a8_gemm

        return "q4_a8_decode" if load_cpu_q4a8_gemm() is not None else "q4"
    if quantized & _KEPT_TYPES:
        return "q4"
    if quantized:
        return "q8_0"
    return half.pop()


def load_model(
    model: str | ModelSource,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    attention: str = "auto",
    sharding: Sharding | None = None,
) -> LoadedModel:
    """Resolve ``model`` and build the network with its weights on ``device``.

    ``dtype`` is a torch float dtype or a name from :data:`DTYPE_CHOICES` (``auto``, ``q4``, ...);
    ``attention`` names the paged-attention backend (see ``attention_backends.BACKENDS``);
    ``sharding``: build and fill only this tensor-parallel rank's part (quantized weights split
    on their blocks; a width that would cut a block is an InvalidArgumentError: ``tp_shard``).
    """
    source = resolve_model(model) if isinstance(model, str) else model
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    weight_format = resolve_dtype(name, source, device)
    weights = INT8_ACTIVATION_DTYPES.get(weight_format, weight_format)
    on_cpu = torch.device(device).type == "cpu"
    compact = weights in QUANT_DTYPES or (on_cpu and weights in HALF_DTYPES)
    quantize = weights if compact else None  # linear and embedding weights' storage
    gguf_blocks = quantize if quantize in QUANT_DTYPES else None  # kept as the file stores them
    compute = torch.float32 if compact else DTYPES[weights]
    backend = make_attention_backend(attention, device)
    if source.kind == "dummy":
        config = dummy_config(source.path)
        weight_iter: Iterable[tuple[str, torch.Tensor | QuantizedWeight]] = iter_dummy_weights(
            config, compute, device
        )
    elif source.kind == "gguf":
        reader = open_gguf(Path(source.path))
        config = gguf_config(reader)
        weight_iter = iter_gguf_weights(reader, config, gguf_blocks)
    elif source.kind == "hf":
        config = read_hf_config(Path(source.path))
        weight_iter = iter_hf_weights(Path(source.path))
    else:  # pragma: no cover - ModelSource.kind is a closed set
        raise ModelLoadError(f"unknown model source kind {source.kind!r}")
    if sharding is None:
        net = empty_model(config, compute, device, backend, quantized=bool(quantize))
    else:
        net = empty_model(sharding.shard_config(config), compute, device, backend,
                          quantized=bool(quantize))  # fmt: skip
        sharding.prepare(net)
        weight_iter = sharding.shard_weights(weight_iter, quantize=quantize)
    load_weights(net, weight_iter, quantize)
    logger.info(
        "loaded %s (%s, %d layers, %s%s) on %s",
        source.name, config.architecture, config.num_layers, weight_format,
        " from --dtype auto" if name == "auto" else "", device,
    )  # fmt: skip
    gaps = net.fast_path_gaps()
    if gaps:
        logger.info("%s models do not take yet: %s", config.architecture, "; ".join(gaps))
    return LoadedModel(
        source=source, config=config, model=net, dtype=compute, weight_format=weight_format,
        fingerprint=fingerprint(config.fingerprint(), weights_digest(source)),
        sharding=sharding,
    )
