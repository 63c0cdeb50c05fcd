"""What a model family does not run yet, applied to an engine configuration once its model is known.

Hybrid linear-attention models (Qwen3.5-MoE, ``ModelConfig.hybrid``) keep a recurrent state per request that
summarizes its whole prefix (``raymoe.kvcache.state_pool``):

* **No radix-cache prefix hits.** A cached prefix's KV is useless to them without the recurrent state at the end
  of that prefix, which is not kept (SGLang's ``MambaRadixCache`` checkpoints states at chunk boundaries to hit on
  those; not built here). ``enable_radix_cache`` is switched off, with a log line; every request computes its whole
  prompt, and a retracted request re-prefills from its first token.
* **No tensor parallelism** (the linear-attention heads are not split) and **no prefill/decode disaggregation** (the
  states would have to move with the KV): refused, naming the option.
"""

from __future__ import annotations

import dataclasses
import logging

from raymoe.config.engine import EngineConfig
from raymoe.config.model import ModelConfig
from raymoe.errors import InvalidRequestError

log = logging.getLogger(__name__)


def apply_model_rules(config: EngineConfig, model: ModelConfig) -> EngineConfig:
    """``config`` with what ``model``'s family cannot use switched off (module docstring).

    Raises:
        InvalidRequestError: an option the family refuses (``tp_size`` > 1 for hybrid models), naming it.
    """
    if model.hybrid is None:
        return config
    if config.parallel.tp_size > 1:
        raise InvalidRequestError("tp_size", f"{model.model_type} runs its linear-attention layers unsplit: "
                                             "tp_size must be 1 (scale with dp_size / ep_size)")
    if config.cache.enable_radix_cache:
        log.info("%s keeps a recurrent state per request: radix-cache prefix hits are off", model.model_type)
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_radix_cache=False))
    return config


def refuse_pd(model: ModelConfig) -> None:
    """Raises InvalidRequestError (``pd_prefill``) for a family whose requests cannot move between engines by KV."""
    if model.hybrid is not None:
        raise InvalidRequestError("pd_prefill", f"{model.model_type} keeps recurrent states that do not move with "
                                                "the KV: prefill/decode disaggregation is not supported")
