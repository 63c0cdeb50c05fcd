"""What a model family does not run yet, applied to an engine configuration once its model is known.

Hybrid linear-attention models (Qwen3.5-MoE, ``ModelConfig.hybrid``) keep a recurrent state per request that
summarizes its whole prefix (``raymoe.kvcache.state_pool``):

* **No radix-cache prefix hits.** A cached prefix's KV is useless to them without the recurrent state at the end
  of that prefix, which is not kept (SGLang's ``MambaRadixCache`` checkpoints states at chunk boundaries to hit on
  those; not built here). ``enable_radix_cache`` is switched off, with a log line; every request computes its whole
  prompt, and a retracted request re-prefills from its first token.
* **No prefill/decode disaggregation** (the states would have to move with the KV): refused, naming the option.
* **Tensor parallelism splits the linear-attention heads**: key and value head counts must divide by ``tp_size``.
* **Speculative decoding keeps per-draft states**: a verify forward advances the recurrent state over every draft
  token, so each linear-attention layer keeps the state after each draft and the rank commits the one its accepted
  drafts reach (``raymoe.kvcache.state_pool.VerifyStates``, as SGLang does). ``ngram`` drafts, and ``nextn`` with
  the checkpoint's MTP layer (``raymoe.models.qwen3_5_mtp``).

``swa_kv_eviction`` (sliding-window layers' KV in per-row rings, ``raymoe.kvcache.swa_ring``) needs a model with
``sliding_attention`` layers and switches radix hits off (a ring holds one request's window only).

Speculative decoding with ``nextn`` needs a checkpoint with a multi-token-prediction layer (DeepSeek-V3, Qwen3.5-MoE,
Qwen3-Next); ``eagle`` a Qwen3-MoE target in float weights.
"""

from __future__ import annotations

import dataclasses
import logging

from raymoe.config.engine import EngineConfig
from raymoe.config.model import ModelConfig
from raymoe.config.speculative import read_head_config
from raymoe.errors import InvalidRequestError

log = logging.getLogger(__name__)


def apply_model_rules(config: EngineConfig, model: ModelConfig) -> EngineConfig:
    """``config`` with what ``model``'s family cannot use switched off (module docstring).

    Raises:
        InvalidRequestError: ``tp_size`` does not divide the linear-attention heads, or ``nextn`` for a model
            without an MTP layer, naming the option.
    """
    if config.speculative.speculative_algorithm in ("nextn", "eagle"):
        config = _draft_model_rules(config, model)
    if config.cache.swa_kv_eviction:
        config = _swa_ring_rules(config, model)
    if model.hybrid is None:
        return config
    tp, lin = config.parallel.tp_size, model.hybrid.linear
    if lin.num_key_heads % tp or lin.num_value_heads % tp:
        raise InvalidRequestError("tp_size", f"{model.model_type}'s linear-attention heads ({lin.num_key_heads} key, "
                                             f"{lin.num_value_heads} value) must divide by tp_size {tp}")
    if config.cache.enable_radix_cache:
        log.info("%s keeps a recurrent state per request: radix-cache prefix hits are off", model.model_type)
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_radix_cache=False))
    return config


def _swa_ring_rules(config: EngineConfig, model: ModelConfig) -> EngineConfig:
    """``swa_kv_eviction`` (``raymoe.kvcache.swa_ring``): a model with sliding-window layers; a request's rings hold
    only its own last window (plus room for a verify step's drafts), which a radix hit cannot bring (hits off) and
    a KV transfer does not carry (``refuse_pd``)."""
    if "sliding_attention" not in model.layer_types:
        raise InvalidRequestError("swa_kv_eviction", f"{model.model_type} has no sliding_attention layers")
    if config.cache.enable_radix_cache:
        log.info("swa_kv_eviction keeps each request's sliding-window KV in its own ring: radix-cache prefix hits "
                 "are off")
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_radix_cache=False))
    return config


def _draft_model_rules(config: EngineConfig, model: ModelConfig) -> EngineConfig:
    """``nextn`` drafts with the checkpoint's MTP layer (``raymoe.models.deepseek_mtp``,
    ``raymoe.models.qwen3_5_mtp``): DeepSeek-V3-style, Qwen3.5-MoE and Qwen3-Next checkpoints that carry one.
    ``eagle`` drafts with a separate head (``raymoe.models.eagle_head``): Qwen3-MoE targets in float weights, the
    head's folder readable. Both read the target's hidden states: the decode graphs return them beside the logits,
    and the draft model's decode passes have graphs of their own (``raymoe.runner.mtp_drafter``)."""
    algo = config.speculative.speculative_algorithm
    if algo == "nextn" and ((model.mla is None and model.hybrid is None) or model.num_nextn_predict_layers < 1):
        raise InvalidRequestError("speculative_algorithm", f"nextn drafts with the checkpoint's multi-token-"
                                                           f"prediction layer; {model.model_type} has none "
                                                           "(num_nextn_predict_layers)")
    if algo == "eagle":
        if model.model_type != "qwen3_moe" or model.quantization is not None:
            raise InvalidRequestError("speculative_algorithm", f"eagle draft heads run on Qwen3-MoE targets with "
                                                               f"float weights, not {model.model_type}")
        read_head_config(config.speculative.speculative_draft_model_path)
    return config


def refuse_pd(model: ModelConfig) -> None:
    """Raises InvalidRequestError (``pd_prefill``) for a family whose requests cannot move between engines by KV."""
    if model.hybrid is not None:
        raise InvalidRequestError("pd_prefill", f"{model.model_type} keeps recurrent states that do not move with "
                                                "the KV: prefill/decode disaggregation is not supported")
