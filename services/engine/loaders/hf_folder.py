"""Load a Hugging Face model folder: ``config.json`` plus one or more ``*.safetensors`` files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.errors import ModelLoadError
from services.engine.loaders.progress import progress
from services.engine.model_config import ModelConfig


def read_hf_config(folder: Path) -> ModelConfig:
    """Parse ``config.json`` into a :class:`ModelConfig` (one-line error when unreadable)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{folder / 'config.json'} is not a JSON object")
    return ModelConfig.from_hf_config(raw)


def iter_hf_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from every safetensors shard of the folder."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder}")
    total = sum(f.stat().st_size for f in files)
    with progress(total, f"loading {folder.name}") as bar:
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():
                        tensor = handle.get_tensor(name)
                        bar.update(tensor.numel() * tensor.element_size())
                        yield name, tensor
            except (OSError, RuntimeError, ValueError) as exc:  # safetensors raises these on corruption
                raise ModelLoadError(f"corrupt or unreadable safetensors file {file.name}: {exc}") from exc
