"""Load a Hugging Face model folder: ``config.json`` plus one or more ``*.safetensors`` files."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.errors import ModelLoadError
from services.engine.core.loaders.progress import progress
from services.common.config_reader import read_hf_config

__all__ = ["hf_weight_dtypes", "iter_hf_weights", "read_hf_config"]


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


def hf_weight_dtypes(folder: Path) -> set[str]:
    """The safetensors dtype names of the folder's 2-D tensors (e.g. ``{"BF16"}``), read from the
    files' JSON headers only (no tensor is loaded); empty when there are no readable files."""
    found: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with file.open("rb") as handle:
                (size,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(size))
        except (OSError, ValueError, struct.error):
            continue  # iter_hf_weights reports an unreadable file when loading
        for name, entry in header.items():
            if name != "__metadata__" and len(entry.get("shape", ())) == 2:
                found.add(str(entry.get("dtype")))
    return found
