"""Weight loaders: ``load_model(name_or_path, dtype, device)`` for the default GGUF, a GGUF file,
a Hugging Face folder or ``dummy:<shape>``. Every failure is a one-line ModelLoadError."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.errors import ModelLoadError
from services.common.model_source import ModelSource, resolve_model
from services.engine.attention_backends import make_attention_backend
from services.engine.loaders.dummy import dummy_config, iter_dummy_weights
from services.engine.loaders.gguf_file import gguf_config, iter_gguf_weights, open_gguf
from services.engine.loaders.hf_folder import iter_hf_weights, read_hf_config
from services.engine.loaders.weights import empty_model, load_weights
from services.engine.model import LlamaForCausalLM
from services.engine.model_config import ModelConfig

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A ready model with its config and where it came from."""

    source: ModelSource
    config: ModelConfig
    model: LlamaForCausalLM
    dtype: torch.dtype


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"`` → ``torch.float32``; a ModelLoadError for anything unsupported."""
    dtype = DTYPES.get(name)
    if dtype is None:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of: {', '.join(DTYPES)}")
    return dtype


def load_model(
    model: str | ModelSource,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    attention: str = "auto",
) -> LoadedModel:
    """Resolve ``model`` and build the network with its weights on ``device``.

    ``attention`` names the paged-attention backend (see ``attention_backends.BACKENDS``).
    """
    source = resolve_model(model) if isinstance(model, str) else model
    backend = make_attention_backend(attention, device)
    if source.kind == "dummy":
        config = dummy_config(source.path)
        net = empty_model(config, dtype, device, backend)
        load_weights(net, iter_dummy_weights(config, dtype, device))
    elif source.kind == "gguf":
        reader = open_gguf(Path(source.path))
        config = gguf_config(reader)
        net = empty_model(config, dtype, device, backend)
        load_weights(net, iter_gguf_weights(reader, config))
    elif source.kind == "hf":
        config = read_hf_config(Path(source.path))
        net = empty_model(config, dtype, device, backend)
        load_weights(net, iter_hf_weights(Path(source.path)))
    else:  # pragma: no cover - ModelSource.kind is a closed set
        raise ModelLoadError(f"unknown model source kind {source.kind!r}")
    logger.info(
        "loaded %s (%s, %d layers, %s) on %s",
        source.name, config.architecture, config.num_layers, dtype, device,
    )
    return LoadedModel(source=source, config=config, model=net, dtype=dtype)
