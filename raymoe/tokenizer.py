"""Tokenizer loading (Hugging Face ``tokenizers``/``transformers``; raymoe adds no tokenization code of its own)."""

from __future__ import annotations

from pathlib import Path

from raymoe.config import ModelConfig
from raymoe.errors import CheckpointError


def load_tokenizer(model: str | Path):
    """``AutoTokenizer`` of a model folder.

    Raises:
        CheckpointError: tokenizer files missing or unreadable.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(str(model), f"cannot load the tokenizer: {e}") from e


def detokenizer(tokenizer):
    """token ids -> text as the schedulers' stop-string checks read it (special tokens skipped)."""
    def detokenize(ids) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    return detokenize


def eos_token_ids(model_config: ModelConfig, tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config/config.json, else the tokenizer's eos token."""
    if model_config.eos_token_ids:
        return model_config.eos_token_ids
    return (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
