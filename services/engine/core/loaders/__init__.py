"""Weight loaders: ``load_model(name_or_path, dtype, device)`` for the default GGUF, a GGUF file,
a Hugging Face folder or ``dummy:<shape>``. Every failure is a one-line ModelLoadError.

Weight dtypes (``--dtype``):

* ``float32`` (the correctness reference), ``bfloat16``, ``float16``: dense weights;
* ``q8_0``: 8-bit weights in groups of 32 (a GGUF's Q8_0 blocks as stored; any other weight,
  HF and float ones included, quantized to Q8_0 at load);
* ``q4``: a GGUF's 4-bit blocks (Q4_0, Q4_1, Q4_K) as stored, its Q8_0 blocks as stored, any
  other matrix as Q8_0; HF folders have no 4-bit weights to keep, so ``q4`` needs a GGUF;
* ``auto`` (the CLI default): on CUDA bfloat16; on CPU the quantized format the GGUF already
  uses (``q4`` for 4-bit files, ``q8_0`` for other quantized ones) when the quantized CPU kernel
  builds here for AVX2 or AVX-512, else float32 (the ``generic`` build's 4-wide kernel measured
  slower than float32 PyTorch on x86, docs/benchmarks.md). bfloat16 is never picked on CPU: even where the CPU has native bf16
  dot products it measured slower than float32 at batch 1 (docs/benchmarks.md).

Quantized weights run on CPU only, with float32 activations and KV cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.errors import ModelLoadError
from services.common.model_source import ModelSource, resolve_model
from services.engine.core.attention_backends import make_attention_backend
from services.engine.core.loaders.dummy import dummy_config, iter_dummy_weights
from services.engine.core.loaders.gguf_file import (
    gguf_config,
    gguf_weight_types,
    iter_gguf_weights,
    open_gguf,
)
from services.engine.core.loaders.hf_folder import iter_hf_weights, read_hf_config
from services.engine.core.loaders.weights import empty_model, load_weights
from services.engine.core.model import LlamaForCausalLM
from services.common.model_config import ModelConfig

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HALF_DTYPES = ("bfloat16", "float16")
QUANT_DTYPES = ("q8_0", "q4")
DTYPE_CHOICES = ("auto", *DTYPES, *QUANT_DTYPES)
_FOUR_BIT_TYPES = {"Q4_0", "Q4_1", "Q4_K"}
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A ready model with its config and where it came from."""

    source: ModelSource
    config: ModelConfig
    model: LlamaForCausalLM
    dtype: torch.dtype  # activations and KV cache
    weight_format: str = "float32"  # a name from DTYPE_CHOICES other than auto


def parse_dtype(name: str) -> str:
    """Check a ``--dtype`` name (see the module docstring); a ModelLoadError for anything else."""
    if name not in DTYPE_CHOICES:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of: {', '.join(DTYPE_CHOICES)}")
    return name


def resolve_dtype(name: str, source: ModelSource, device: str = "cpu") -> str:
    """The concrete dtype ``name`` means for ``source`` on ``device`` (``auto`` resolved)."""
    name = parse_dtype(name)
    kind = torch.device(device).type
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
    if source.kind != "gguf":
        return "float32"
    from services.engine.core.kernels.cpu_qgemv import load_cpu_qgemv

    types = gguf_weight_types(open_gguf(Path(source.path)))
    quantized = types - _FLOAT_TYPES
    kernel = load_cpu_qgemv()
    if not quantized or kernel is None or kernel.isa == "generic":
        return "float32"
    return "q4" if quantized & _FOUR_BIT_TYPES else "q8_0"


def load_model(
    model: str | ModelSource,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    attention: str = "auto",
) -> LoadedModel:
    """Resolve ``model`` and build the network with its weights on ``device``.

    ``dtype`` is a torch float dtype or a name from :data:`DTYPE_CHOICES` (``auto``, ``q4``, ...);
    ``attention`` names the paged-attention backend (see ``attention_backends.BACKENDS``).
    """
    source = resolve_model(model) if isinstance(model, str) else model
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    weight_format = resolve_dtype(name, source, device)
    quantize = weight_format if weight_format in QUANT_DTYPES else None
    compute = DTYPES.get(weight_format, torch.float32)
    backend = make_attention_backend(attention, device)
    if source.kind == "dummy":
        config = dummy_config(source.path)
        net = empty_model(config, compute, device, backend, quantized=bool(quantize))
        load_weights(net, iter_dummy_weights(config, compute, device), quantize)
    elif source.kind == "gguf":
        reader = open_gguf(Path(source.path))
        config = gguf_config(reader)
        net = empty_model(config, compute, device, backend, quantized=bool(quantize))
        load_weights(net, iter_gguf_weights(reader, config, quantize), quantize)
    elif source.kind == "hf":
        config = read_hf_config(Path(source.path))
        net = empty_model(config, compute, device, backend, quantized=bool(quantize))
        load_weights(net, iter_hf_weights(Path(source.path)), quantize)
    else:  # pragma: no cover - ModelSource.kind is a closed set
        raise ModelLoadError(f"unknown model source kind {source.kind!r}")
    logger.info(
        "loaded %s (%s, %d layers, %s%s) on %s",
        source.name, config.architecture, config.num_layers, weight_format,
        " from --dtype auto" if name == "auto" else "", device,
    )  # fmt: skip
    if weight_format in HALF_DTYPES and torch.device(device).type == "cpu":
        logger.warning(
            "--dtype %s on CPU runs PyTorch's half-precision ops (Tandem has no native kernel for "
            "them); it measured slower than float32 and than --dtype auto on every CPU tried "
            "(docs/benchmarks.md)", weight_format,
        )  # fmt: skip
    return LoadedModel(
        source=source, config=config, model=net, dtype=compute, weight_format=weight_format
    )
