"""Load a Hugging Face model folder: ``config.json`` plus one or more ``*.safetensors`` files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.errors import ModelLoadError
from services.engine.core.loaders.progress import progress
from services.common.config_reader import read_hf_config

__all__ = ["iter_hf_weights", "read_hf_config"]


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
