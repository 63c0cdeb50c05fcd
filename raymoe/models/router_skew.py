"""Skewed routers for tiny checkpoints (``raymoe make-checkpoint --router-skew S``) and the expert load they cause.

Trained MoE models route unevenly: in each layer a few experts take most tokens and expert popularity falls off
with rank (Zipf-like), with other hot experts in each layer. Random tiny checkpoints route almost uniformly, so
expert-parallel load balancing has nothing to balance on them. ``apply_router_skew`` gives expert ``e`` of each MoE
layer a router offset, the same for every token, of ``-S * ZIPF_LOGIT * log(1 + rank(e))`` router-logit noise stds
(DeepSeek-V3: ``-S * ZIPF_SCORE * log(1 + rank(e))`` in sigmoid-score units); ``rank`` is a seeded permutation per
layer (0 = hottest) whose hottest ``max(1, E // 4)`` experts lie in the first half ``[0, E / 2)``, so with
contiguous expert-parallel blocks the low ranks hold the hot experts. How the offset reaches the router:

- **Bias** (``deepseek_v3``: ``e_score_correction_bias``, which moves the choice only, not the routing weights;
  ``gpt_oss``: the router's logit bias): the offset is added to the bias.
- **Bias channel** (``qwen3_moe``, ``deepseek_v2``, ``mixtral``: routers without a bias). A router reads
  ``x = w * h / rms(h)`` (post-attention RMSNorm of the residual ``h``) whose mean over tokens is near zero in a
  random model, so no gate row alone gives a constant offset. ``_bias_channel`` makes a seeded unit direction ``u``
  a channel that the embedding writes (``h . u = c = SHARED_RATIO * sqrt(H)`` for every token, as trained models'
  residual streams carry large token-independent components that act as biases: Sun et al., "Massive Activations
  in Large Language Models", arXiv:2402.17762), that no layer writes and that only the routers read. Then
  ``x . d = c |w * u| / rms(h)`` for every token (``d`` = unit ``w * u``) and gate row ``e`` gets
  ``offset_e * |row| * sigma_L / (c |w * u|)`` along ``d``: ``rms(h)`` cancels against the router noise
  ``|row| sigma_L / rms(h)``, where ``sigma_L^2 = 1 + RESIDUAL_VAR_PER_LAYER * (L + 1/2)`` estimates the residual's
  per-coordinate token variance at decoder layer ``L``.

Measured with ``router_load`` (64 random prompts of 32 tokens; every MoE layer of 4- and 12-layer builds of all five
architectures) at ``S = 1``: with 16, 32 or 64 experts (top-2, 4, 8) the hottest eighth of the experts takes
0.73-0.98 of the routed pairs and the busier of two contiguous halves 0.94-1.00; with 8 experts and top-2 the hottest
eighth (one expert) takes 0.48-0.50, the cap ``1 / top_k`` (it is in nearly every token's top-2), and the busier half
0.82-1.00 (gpt-oss, whose random router bias competes: 0.63-0.99). ``S = 0.5`` is milder (16 experts: 0.64-0.79;
8 experts: 0.37-0.48); ``S = 0`` gives 0.14-0.34 (``make_checkpoint`` does not call this then).

``router_load`` counts the experts transformers' own forward selects per MoE layer; ``hot_share`` and
``rank_share`` turn the counts into the two figures above.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from raymoe.errors import InvalidRequestError

ZIPF_LOGIT = 2.5
"""Offset slope of softmax / top-k routers per unit S, in router-logit noise stds per ``log(1 + rank)``."""
ZIPF_SCORE = 1.0
"""Offset slope of DeepSeek-V3's sigmoid scores (in (0, 1)) per unit S, per ``log(1 + rank)``."""
SHARED_RATIO = 1.0
"""The bias channel's value ``h . u`` over ``sqrt(hidden_size)`` (the norm of a random embedding row)."""
RESIDUAL_VAR_PER_LAYER = 1.7
"""Per-coordinate variance the residual's token part gains per decoder layer in these random builders with the
bias channel in place (measured over 12 layers: 1.4 Mixtral, 1.5 Qwen3-MoE, 2.1 DeepSeek-V2)."""
SEED_SALT = 0x5EED_0E9B
"""Added to the build seed for the skew's own generator: the weight stream is untouched."""


@dataclass(frozen=True)
class _Router:
    """Tensor names of one architecture's router (``{i}`` = decoder layer) and how the offset reaches it."""

    weight: str
    bias: str | None = None       # offsets go here when set (``score``: sigmoid-score units, else logit units)
    score_bias: bool = False
    norm: str = "model.layers.{i}.post_attention_layernorm.weight"


ROUTERS: dict[str, _Router] = {
    "qwen3_moe": _Router("model.layers.{i}.mlp.gate.weight"),
    "deepseek_v2": _Router("model.layers.{i}.mlp.gate.weight"),
    "deepseek_v3": _Router("model.layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate.e_score_correction_bias",
                           score_bias=True),
    "mixtral": _Router("model.layers.{i}.block_sparse_moe.gate.weight"),
    "gpt_oss": _Router("model.layers.{i}.mlp.router.weight", "model.layers.{i}.mlp.router.bias"),
}
"""Architectures ``apply_router_skew`` can skew (keys of ``raymoe.models.checkpoint.ARCHS``)."""


def check_router_skew(skew: float) -> float:
    """``skew`` as a float; raises ``InvalidRequestError("router_skew")`` unless it is finite and >= 0."""
    try:
        value = float(skew)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError("router_skew", f"must be a number >= 0, got {skew!r}") from e
    if not math.isfinite(value) or value < 0:
        raise InvalidRequestError("router_skew", f"must be a finite number >= 0, got {skew!r}")
    return value


def expert_ranks(num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """[E] int64: ``ranks[e]`` = popularity rank of expert ``e`` (0 = hottest). The hottest ``max(1, E // 4)``
    ranks go to random experts of the first half ``[0, max(1, E // 2))``, the others to the rest at random."""
    half, hot = max(1, num_experts // 2), max(1, num_experts // 4)
    first = torch.randperm(half, generator=gen)[:hot]
    taken = torch.zeros(num_experts, dtype=torch.bool)
    taken[first] = True
    rest = torch.nonzero(~taken).flatten()
    order = torch.cat([first, rest[torch.randperm(rest.numel(), generator=gen)]])   # order[rank] = expert
    ranks = torch.empty(num_experts, dtype=torch.int64)
    ranks[order] = torch.arange(num_experts)
    return ranks


def shared_direction(hidden_size: int, gen: torch.Generator) -> torch.Tensor:
    """[hidden_size] float32 unit vector ``u`` of the bias channel: the first draw of the skew generator
    (``torch.Generator().manual_seed(seed + SEED_SALT)``)."""
    u = torch.randn(hidden_size, generator=gen)
    return u / u.norm()


def zipf_offsets(ranks: torch.Tensor, slope: float) -> torch.Tensor:
    """[E] float32 ``-slope * log(1 + ranks)``: 0 for the hottest expert, falling with rank."""
    return -slope * torch.log1p(ranks.to(torch.float32))


def apply_router_skew(tensors: dict[str, torch.Tensor], arch: str, skew: float, seed: int,
                      num_experts: int) -> dict[str, torch.Tensor]:
    """Return a copy of a built checkpoint's float32 ``tensors`` with routers skewed by ``skew`` (see the module doc).

    Bias architectures change only their router biases; shared-direction ones change the embedding, the gate rows
    and (rank-1 projections) the matrices that read or write the residual. Deterministic in ``(skew, seed)``.

    Raises:
        InvalidRequestError: ``router_skew`` negative or not finite, or ``arch`` not in ``ROUTERS``.
    """
    skew = check_router_skew(skew)
    if arch not in ROUTERS:
        raise InvalidRequestError("router_skew", f"architecture {arch!r} cannot be skewed; known: {sorted(ROUTERS)}")
    router = ROUTERS[arch]
    out = dict(tensors)
    if skew == 0:
        return out
    gen = torch.Generator().manual_seed(seed + SEED_SALT)
    layers = [i for i in range(len(tensors)) if router.weight.format(i=i) in tensors]   # MoE layers by depth
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    u, c = shared_direction(hidden, gen), SHARED_RATIO * math.sqrt(hidden)
    if router.bias is None and layers:
        _bias_channel(tensors, out, u, c, router)
    for i in layers:
        ranks = expert_ranks(num_experts, gen)
        w = tensors[router.weight.format(i=i)]
        if router.bias is not None:
            name = router.bias.format(i=i)
            slope = ZIPF_SCORE if router.score_bias else ZIPF_LOGIT * _logit_noise(w)
            out[name] = tensors[name] + skew * zipf_offsets(ranks, slope)
            continue
        d = tensors[router.norm.format(i=i)] * u
        d_hat = d / d.norm()
        sigma = math.sqrt(1.0 + RESIDUAL_VAR_PER_LAYER * (i + 0.5))
        # x . d_hat = c |d| / rms(h) for every token; the router's noise is |row| sigma / rms(h): rms(h) cancels.
        coef = skew * zipf_offsets(ranks, ZIPF_LOGIT) * _logit_noise(w) * sigma / (c * d.norm())
        out[router.weight.format(i=i)] = w + (coef - w @ d_hat)[:, None] * d_hat[None, :]
    return out


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")
_ATTN_READER = re.compile(r"self_attn\.(q_proj|k_proj|v_proj|q_a_proj|kv_a_proj_with_mqa)")
_MLP_READER = re.compile(r"(mlp|block_sparse_moe)\.(.+\.)?(gate_proj|up_proj|w1|w3)")
_WRITER = re.compile(r"self_attn\.o_proj|(mlp|block_sparse_moe)\.(.+\.)?(down_proj|w2)")
_INNER = re.compile(r"self_attn\.(q_b_proj|kv_b_proj)|.*norm")   # read a inner norm's output, or 1-D norms


def _bias_channel(tensors: dict[str, torch.Tensor], out: dict[str, torch.Tensor], u: torch.Tensor, c: float,
                  router: _Router) -> None:
    """Write into ``out`` the tensors that make ``c * u`` a channel of the residual only the routers read.

    The embedding rows lose their component along ``u`` and gain ``c * u``; attention and MLP output projections
    lose their output component along ``u`` (no layer writes it); every matrix that reads a normed residual
    (``w * h / rms(h)``, RMSNorm weight ``w``) loses its input component along ``w * u`` (no layer but the router
    sees it), the LM head included. So ``h . u = c`` for every token at every depth, and the rest of the model
    computes as before, its normed inputs scaled by ``|n| / |h|`` (``n`` the token part of ``h``).

    Raises:
        ValueError: a layer tensor that is none of these (a builder's new matrix must be classified here, or the
            channel would leak into it).
    """
    embed = tensors["model.embed_tokens.weight"]
    out["model.embed_tokens.weight"] = embed - (embed @ u)[:, None] * u[None, :] + c * u[None, :]
    for name, t in tensors.items():
        m = _LAYER.fullmatch(name)
        if m is None:
            continue
        p = f"model.layers.{m.group(1)}."
        if _ATTN_READER.fullmatch(m.group(2)):
            out[name] = _blind(t, tensors[p + "input_layernorm.weight"] * u)
        elif _MLP_READER.fullmatch(m.group(2)):
            out[name] = _blind(t, tensors[p + "post_attention_layernorm.weight"] * u)
        elif _WRITER.fullmatch(m.group(2)):
            out[name] = t - u[:, None] * (u @ t)[None, :]
        elif not (_INNER.fullmatch(m.group(2)) or name == router.weight.format(i=m.group(1))):
            raise ValueError(f"router_skew: {name} neither reads nor writes the residual as far as the bias channel "
                             "knows; classify it in raymoe.models.router_skew")
    if "lm_head.weight" in tensors:
        out["lm_head.weight"] = _blind(tensors["lm_head.weight"], tensors["model.norm.weight"] * u)


def _blind(weight: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """[out, in] ``weight`` without its input component along ``d`` [in]."""
    d_hat = d / d.norm()
    return weight - (weight @ d_hat)[:, None] * d_hat[None, :]


def _logit_noise(weight: torch.Tensor) -> float:
    """Std of router logits over tokens whose router input has unit RMS: the mean gate-row norm."""
    return float(weight.norm(dim=1).mean())


# ------------------------------------------------------------------------------------------------- measuring

_EXPERTS = re.compile(r".*\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts")


def router_load(model_path: str | Path, num_prompts: int = 64, prompt_len: int = 32, seed: int = 0) -> torch.Tensor:
    """Count transformers' top-k expert selections per MoE layer on random prompts.

    Loads ``model_path`` with ``transformers.AutoModelForCausalLM`` (float32, CPU), runs one forward over
    ``num_prompts`` prompts of ``prompt_len`` token ids drawn uniformly from the vocabulary (seeded by ``seed``),
    and counts the ``top_k_index`` each MoE block hands its experts module.

    Returns:
        [L_moe, E] int64: row ``j`` = the ``j``-th MoE layer by depth; each row sums to
        ``num_prompts * prompt_len * top_k``.

    Raises:
        ValueError: the model has no MoE experts module transformers' naming (``layers.N.mlp.experts``) finds.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    num_experts = _num_experts(model.config)
    counts: dict[int, torch.Tensor] = {}

    def count(layer: int):
        def hook(_module, args, kwargs):
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
            index = index.reshape(-1)
            index = index[index < num_experts]
            counts[layer] = counts.get(layer, 0) + torch.bincount(index, minlength=num_experts).to(torch.int64)
        return hook

    handles = [mod.register_forward_pre_hook(count(int(m.group(1))), with_kwargs=True)
               for name, mod in model.named_modules() if (m := _EXPERTS.fullmatch(name))]
    if not handles:
        raise ValueError(f"{model_path}: no MoE experts module (layers.N.mlp.experts) found")
    ids = torch.randint(0, model.config.vocab_size, (num_prompts, prompt_len),
                        generator=torch.Generator().manual_seed(seed))
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.stack([counts[i] for i in sorted(counts)])


def _num_experts(config) -> int:
    for name in ("num_experts", "n_routed_experts", "num_local_experts"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ValueError("config names no expert count (num_experts, n_routed_experts, num_local_experts)")


def hot_share(load: torch.Tensor, fraction: float = 1 / 8) -> torch.Tensor:
    """[L] float64: per layer, the share of routed pairs the hottest ``max(1, round(E * fraction))`` experts take.

    ``load``: [L, E] counts (``router_load``)."""
    top = max(1, round(load.shape[1] * fraction))
    loads = load.to(torch.float64)
    return loads.sort(dim=1, descending=True).values[:, :top].sum(1) / loads.sum(1)


def rank_share(load: torch.Tensor, ep: int) -> torch.Tensor:
    """[L] float64: per layer, the share of routed pairs on the busiest of ``ep`` contiguous expert blocks (rank r
    holds experts ``[r E / ep, (r + 1) E / ep)``). Raises ValueError unless ``ep`` divides E."""
    if ep < 1 or load.shape[1] % ep:
        raise ValueError(f"ep={ep} must divide the expert count {load.shape[1]}")
    per_rank = load.to(torch.float64).reshape(load.shape[0], ep, -1).sum(2)
    return per_rank.max(1).values / per_rank.sum(1)
