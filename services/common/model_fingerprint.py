"""The model fingerprint: what every process of a deployment must agree it serves, covering
the weights' bytes and not only the shape.

``ModelConfig.fingerprint()`` hashes the architecture and shape. Two checkpoints of one shape (a
base model and its fine-tune, two quantizations) share it, so KV or routing from one would be
silently accepted by the other. The fingerprint here adds a digest of the weight files:

1. :func:`weights_digest` — sha256 over the files the weights are read from, in name order, each
   as its name, size and bytes (a GGUF file; a Hugging Face folder's ``*.safetensors``; a dummy
   shape's name). ``hashlib.file_digest`` streams them outside the GIL at disk speed (a 135M GGUF
   in a fraction of a second), while the worker loads the model anyway;
2. :func:`fingerprint` — ``sha256(shape fingerprint ":" weights digest)``, 16 hex digits, the
   value of ``KVLayout.model_fingerprint`` (the KV hand-off), ``WorkerStats.model_fingerprint``
   and ``ModelInfo.model_fingerprint`` (the gateway refuses a worker whose value is not the
   tokenizer's).

Torch-free: the tokenizer computes it without loading the model.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from services.common.errors import ModelLoadError
from services.common.model_source import ModelSource

logger = logging.getLogger(__name__)


def weight_files(source: ModelSource) -> list[Path]:
    """The files ``source``'s weights are read from (none for dummy weights)."""
    if source.kind == "gguf":
        return [Path(source.path)]
    if source.kind == "hf":
        return sorted(Path(source.path).glob("*.safetensors"))
    return []


def weights_digest(source: ModelSource) -> str:
    """sha256 (hex) of ``source``'s weight files (see the module docstring).

    Raises:
        ModelLoadError: a weight file cannot be read.
    """
    digest = hashlib.sha256(f"{source.kind}\0".encode())
    if source.kind == "dummy":
        digest.update(source.path.encode())
    for path in weight_files(source):
        try:
            with path.open("rb") as f:
                size = path.stat().st_size
                digest.update(f"{path.name}\0{size}\0".encode())
                digest.update(hashlib.file_digest(f, "sha256").digest())
        except OSError as err:
            raise ModelLoadError(f"cannot read the weights in {path}: {err}") from err
    return digest.hexdigest()


def fingerprint(shape_fingerprint: str, weights: str) -> str:
    """The deployment-wide model fingerprint for a shape and a weights digest."""
    return hashlib.sha256(f"{shape_fingerprint}:{weights}".encode()).hexdigest()[:16]
