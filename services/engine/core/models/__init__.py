"""The model registry: one module per family, and the table from a family name
(:attr:`ModelConfig.architecture <services.common.model_config.ModelConfig.architecture>`, itself
read from the checkpoint's architecture through :data:`~services.common.model_config.ARCHITECTURES`)
to its class."""

from __future__ import annotations

from services.common.errors import ModelLoadError
from services.common.model_config import ModelConfig
from services.engine.core.models.base import CausalLM
from services.engine.core.models.gemma2 import Gemma2ForCausalLM
from services.engine.core.models.gemma3 import Gemma3ForCausalLM
from services.engine.core.models.llama import LlamaForCausalLM
from services.engine.core.models.phi3 import Phi3ForCausalLM
from services.engine.core.models.qwen3 import Qwen3ForCausalLM
from services.engine.core.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}

__all__ = ["MODEL_CLASSES", "CausalLM", "model_class"]


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The class that builds ``config``'s family."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ModelLoadError(
            f"no model for family {config.architecture!r}; known: {', '.join(sorted(MODEL_CLASSES))}"
        )
    return cls
