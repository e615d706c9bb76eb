"""How a model's hidden states become one embedding: the pooling mode and L2 normalisation.

Read from the model folder the way sentence-transformers reads it, so a checkpoint published as
an embedding model is pooled as its authors pooled it:

1. ``modules.json`` lists the pipeline; its ``sentence_transformers.models.Pooling`` entry names
   a folder (``1_Pooling``) whose ``config.json`` says the mode: ``pooling_mode_lasttoken``
   (Qwen3-Embedding, e5-mistral) → ``last``, ``pooling_mode_mean_tokens`` → ``mean``; a
   ``sentence_transformers.models.Normalize`` entry means L2-normalised output;
2. without ``modules.json`` (any causal LM used as an embedder, a GGUF, ``dummy:``) the default is
   ``last``, normalised (what decoder embedding models use, and OpenAI's vectors are unit length);
3. the prefill worker's ``--pooling last|mean`` overrides the mode either way.

Any other mode in the folder (CLS, max, weighted mean) is refused with a ModelLoadError naming
it, rather than pooled some other way. Torch-free: the worker's flags and tests read it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import ModelLoadError

logger = logging.getLogger(__name__)

POOLING_MODES = ("last", "mean")
"""``last``: the hidden state of the input's last token; ``mean``: the mean over its tokens."""

_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_MODE_KEYS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
_REFUSED_KEYS = (
    "pooling_mode_cls_token",
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """The pooling mode (one of :data:`POOLING_MODES`) and whether vectors are L2-normalised."""

    mode: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ModelLoadError(f"unsupported pooling {self.mode!r}; choose one of: "
                                 f"{', '.join(POOLING_MODES)}")  # fmt: skip


def read_pooling_config(folder: Path | None, override: str | None = None) -> PoolingConfig:
    """The pooling of the model in ``folder`` (None: a model without a folder, e.g. a GGUF file),
    with ``override`` (``--pooling``) replacing its mode; see the module docstring."""
    if override is not None:
        PoolingConfig(override)  # refuse an unknown mode first
    try:
        found = _from_sentence_transformers(folder) if folder is not None else None
    except ModelLoadError:
        if override is None:
            raise
        found = None  # the folder's own mode is one Tandem lacks; the flag replaces it
    config = found or PoolingConfig()
    if override is not None:
        config = PoolingConfig(override, config.normalize)
    return config


def _from_sentence_transformers(folder: Path) -> PoolingConfig | None:
    modules = _read_json(folder / "modules.json")
    if modules is None:
        return None
    if not isinstance(modules, list):
        raise ModelLoadError(f"{folder / 'modules.json'} is not a JSON list")
    types = {str(m.get("type", "")): str(m.get("path", "")) for m in modules if isinstance(m, dict)}
    normalize = _NORMALIZE_MODULE in types
    mode = "last"
    if _POOLING_MODULE in types:
        pooling = _read_json(folder / types[_POOLING_MODULE] / "config.json")
        if not isinstance(pooling, dict):
            raise ModelLoadError(f"{folder / types[_POOLING_MODULE]} has no readable config.json")
        modes = [m for key, m in _MODE_KEYS.items() if pooling.get(key)]
        refused = [key for key in _REFUSED_KEYS if pooling.get(key)]
        if refused or len(modes) != 1:
            raise ModelLoadError(
                f"unsupported sentence-transformers pooling in {folder.name}: "
                f"{', '.join(refused) or 'none or several modes'}; Tandem pools by "
                "pooling_mode_lasttoken or pooling_mode_mean_tokens (--pooling overrides)")
        mode = modes[0]
    logger.info("pooling from %s: %s%s", folder / "modules.json", mode,
                ", normalized" if normalize else "")  # fmt: skip
    return PoolingConfig(mode, normalize)


def _read_json(path: Path) -> Any:
    """The parsed file, or None when it does not exist; ModelLoadError when unreadable."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
