"""Model registry: Hugging Face ``model_type`` -> raymoe model class (imported lazily)."""

from __future__ import annotations

import importlib

from raymoe.errors import CheckpointError

_MODELS = {
    "qwen3_moe": ("raymoe.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "mixtral": ("raymoe.models.mixtral", "MixtralForCausalLM"),
    "deepseek_v2": ("raymoe.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("raymoe.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "gpt_oss": ("raymoe.models.gpt_oss", "GptOssForCausalLM"),
    "qwen3_5_moe_text": ("raymoe.models.qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "qwen3_5_moe": ("raymoe.models.qwen3_5_moe", "Qwen3_5MoeForCausalLM"),  # the language model of the image-text one
    "qwen3_next": ("raymoe.models.qwen3_next", "Qwen3NextForCausalLM"),
}


def get_model_class(model_type: str):
    """Return the model class for ``model_type``.

    Raises:
        CheckpointError: the architecture is not supported.
    """
    if model_type not in _MODELS:
        raise CheckpointError("config.json", f"model_type {model_type!r} is not supported "
                                             f"(supported: {sorted(_MODELS)})")
    module, name = _MODELS[model_type]
    return getattr(importlib.import_module(module), name)
