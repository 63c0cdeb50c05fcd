"""Training an EAGLE-style draft head (``raymoe.models.eagle_head``) for a trained Qwen3-MoE checkpoint, on CPU.

The head (Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", 2024) reads the frozen
target's final hidden state ``h_i`` and the embedding of ``x_{i+1}`` and predicts ``x_{i+2}`` through the target's LM
head: first on the standard library's source (the corpus the demo tokenizer was trained on), then, with
``distill_steps``, on the target's own greedy text (``raymoe.models.draft_distill``), which its drafts are checked
against. ``make-checkpoint --arch eagle --target DIR`` runs it.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from raymoe.models.train_demo import DISTILL_POOL, TrainLoop, TrainReport, corpus_ids, distill_into


class EagleTrainHead(nn.Module):
    """The EAGLE head of ``raymoe.models.eagle_head`` for training: ``fc`` over ``[emb(x_{i+1}); h_i]``, one dense
    transformers ``Qwen3DecoderLayer``, a norm; the target's embedding and LM head are used frozen."""

    def __init__(self, target_config, intermediate_size: int):
        super().__init__()
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm

        t = target_config
        h = t.hidden_size
        self.config = Qwen3Config(vocab_size=t.vocab_size, hidden_size=h, intermediate_size=intermediate_size,
                                  num_hidden_layers=1, num_attention_heads=t.num_attention_heads,
                                  num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
                                  rms_norm_eps=t.rms_norm_eps, max_position_embeddings=t.max_position_embeddings)
        self.config._attn_implementation = "sdpa"
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = Qwen3DecoderLayer(self.config, 0)
        self.norm = Qwen3RMSNorm(h, eps=t.rms_norm_eps)

    def forward(self, hidden, next_embeds, position_embeddings, mask):
        x = self.fc(torch.cat([next_embeds, hidden], dim=-1))
        x = self.layer(x, attention_mask=mask, position_embeddings=position_embeddings)
        return self.norm(x[0] if isinstance(x, tuple) else x)


def eagle_logits(hf, head: EagleTrainHead, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The head's logits [B, S-1, V] through the target's LM head, over ``ids`` [B, S] and the target's final
    hidden states ``hidden`` [B, S, H]: position ``i`` reads ``hidden[:, i]`` and ``ids[:, i + 1]`` at rotary
    position ``i``."""
    batch, seq = ids.shape
    pos = torch.arange(seq - 1, dtype=torch.int64)[None].expand(batch, -1)
    mask = torch.full((seq - 1, seq - 1), float("-inf")).triu(1)[None, None]
    h = hidden[:, :-1]
    return hf.lm_head(head(h, hf.model.embed_tokens(ids[:, 1:]), hf.model.rotary_emb(h, pos), mask))


def train_eagle_head(target: str | Path, out: str | Path, seconds: float, *, steps: int | None = None, seed: int = 0,
                     seq_len: int = 128, batch_size: int = 16, lr: float = 3e-3, intermediate_size: int | None = None,
                     progress: bool = True, log_every: int = 10, distill_steps: int = 0,
                     distill_pool: int = DISTILL_POOL) -> TrainReport:
    """Train an EAGLE draft head (``raymoe.models.eagle_head``) for the Qwen3-MoE checkpoint ``target`` on the
    standard library's source and write it to the folder ``out`` in EAGLE's layout (``fc.weight``,
    ``norm.weight``, ``layers.0.*``, ``config.json`` with ``model_type`` ``eagle_head``, ``train_log.json``).

    At position ``i`` the head reads the frozen target's final hidden state ``h_i`` and the embedding of
    ``x_{i+1}`` and is trained to predict ``x_{i+2}`` through the target's LM head (cross-entropy).

    Args:
        target: the target's folder. out: the head's folder (created). seconds / steps / seed / seq_len /
            batch_size / lr / progress: as :func:`train_checkpoint`. intermediate_size: the head's MLP width
            (None: the target's ``moe_intermediate_size`` times its ``num_experts_per_tok``). distill_steps,
            distill_pool: then train the head this many steps on the target's greedy continuations of that many
            corpus prompts (``raymoe.models.draft_distill``; 0: none).
    Raises:
        ValueError: the target is not a Qwen3-MoE folder, the budget is not positive, or a negative distillation.
    """
    from transformers import AutoModelForCausalLM

    from raymoe.config.speculative import HEAD_MODEL_TYPE
    from raymoe.tokenizer import load_tokenizer

    target, out = Path(target), Path(out)
    cfg = json.loads((target / "config.json").read_text())
    if cfg["model_type"] != "qwen3_moe":
        raise ValueError(f"EAGLE heads are trained for qwen3_moe targets, not {cfg['model_type']!r}")
    if distill_steps < 0 or distill_pool < 1:
        raise ValueError("train_eagle_head needs distill_steps >= 0 and distill_pool >= 1")
    inter = intermediate_size or cfg["moe_intermediate_size"] * cfg["num_experts_per_tok"]
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    for p in hf.parameters():
        p.requires_grad_(False)
    torch.manual_seed(seed)
    head = EagleTrainHead(hf.config, inter)
    eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], int) else cfg["eos_token_id"][0]
    data = corpus_ids(load_tokenizer(str(target)), eos)
    gen = torch.Generator().manual_seed(seed)
    loop = TrainLoop(out.name, seconds, steps, lr, list(head.parameters()), batch_size * seq_len, log_every,
                      progress)
    while loop.next():
        starts = torch.randint(0, data.numel() - seq_len - 2, (batch_size,), generator=gen).tolist()
        ids = torch.stack([data[s:s + seq_len] for s in starts])
        target_ids = torch.stack([data[s + 2:s + seq_len + 1] for s in starts])
        with torch.no_grad():
            hidden = hf.model(input_ids=ids).last_hidden_state
        logits = eagle_logits(hf, head, ids, hidden)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), target_ids.flatten())
        loop.step(loss, loss.item())
    report = loop.finish()
    if distill_steps > 0:
        distill_into(report, hf, head, lambda i, h: eagle_logits(hf, head, i, h), data,
                     name=f"{out.name} on the target's greedy text", steps=distill_steps, pool_size=distill_pool,
                     seed=seed, batch_size=batch_size, log_every=log_every, progress=progress)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"fc.weight": head.fc.weight, "norm.weight": head.norm.weight}
    tensors.update({f"layers.0.{k}": v for k, v in head.layer.state_dict().items()})
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    c = hf.config
    (out / "config.json").write_text(json.dumps({
        "architectures": ["EagleHead"], "model_type": HEAD_MODEL_TYPE, "target_model_type": cfg["model_type"],
        "hidden_size": c.hidden_size, "intermediate_size": inter, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size}, indent=2) + "\n")
    (out / "train_log.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report
