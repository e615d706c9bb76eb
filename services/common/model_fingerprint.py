"""The model fingerprint: what every process of a deployment must agree it serves, covering
the weights' bytes and not only the shape.

``ModelConfig.fingerprint()`` hashes the architecture and shape. Two checkpoints of one shape (a
base model and its fine-tune, two quantizations) share it, so KV or routing from one would be
silently accepted by the other. The fingerprint here adds a digest of the weight files:

1. :func:`weights_digest` — sha256 over the files the model is read from, in name order, each
   as its name, size and bytes: a GGUF file (which holds the weights, the tokenizer and the chat
   template); a Hugging Face folder's ``*.safetensors`` and its tokenizer and chat-template files
   (:data:`HF_TOKENIZER_FILES` that exist: ``tokenizer.json``, ``tokenizer_config.json`` — where
   the chat template usually lives — ``chat_template.jinja`` …), so two folders with one set of
   weights but another vocabulary or template (which would tokenize or render prompts
   differently, and so cache and route them differently) do not pass for one model; a dummy
   shape's name. ``hashlib.file_digest`` streams them outside the GIL at disk speed (a 135M GGUF
   in a fraction of a second), while the worker loads the model anyway;
2. :func:`fingerprint` — ``sha256(shape fingerprint ":" weights digest)``, 16 hex digits, the
   value of ``KVLayout.model_fingerprint`` (the KV hand-off), ``WorkerStats.model_fingerprint``
   and ``ModelInfo.model_fingerprint`` (the gateway refuses a worker whose value is not the
   tokenizer's).

Torch-free: the tokenizer computes it without loading the model. It fails closed: a file that
cannot be read raises :class:`ModelLoadError` (never a partial digest), and the tokenizer refuses
to start without a fingerprint (``services/tokenizer/main.py``).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from services.common.errors import ModelLoadError
from services.common.model_source import ModelSource

logger = logging.getLogger(__name__)


HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
"""A Hugging Face folder's files that decide how text becomes tokens and how chat messages are
rendered; those present are part of the fingerprint."""


def weight_files(source: ModelSource) -> list[Path]:
    """The files ``source``'s model is read from, in name order (none for dummy weights): its
    weights and, for a Hugging Face folder, its tokenizer and chat-template files."""
    if source.kind == "gguf":
        return [Path(source.path)]
    if source.kind == "hf":
        folder = Path(source.path)
        # a name that is there but cannot be read (a dangling link) is kept: reading it fails
        files = [*folder.glob("*.safetensors"),
                 *(path for name in HF_TOKENIZER_FILES
                   if (path := folder / name).exists() or path.is_symlink())]
        return sorted(files, key=lambda path: path.name)
    return []


def weights_digest(source: ModelSource) -> str:
    """sha256 (hex) of ``source``'s model files (see the module docstring).

    Raises:
        ModelLoadError: a file cannot be read (fail closed: no partial digest).
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
