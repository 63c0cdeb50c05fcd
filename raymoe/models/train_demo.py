"""Training a tiny seeded checkpoint on the Python standard library's source, so its text looks like Python.

The random-weight demo checkpoints write noise: no draft of speculative decoding is ever accepted on them, their
routers have none of the skew trained routers have, and a user cannot tell a broken engine from a working one by
reading its output. ``train_checkpoint`` trains a folder written by ``make_checkpoint`` in place, on CPU, for a
bounded wall-clock budget (or a fixed number of steps), with transformers' own model classes (the same code that is
raymoe's numerical oracle), on the corpus its tokenizer was trained on (``raymoe.models.tokenizer_builder``).

DeepSeek-V3 checkpoints also get one multi-token-prediction (MTP) layer, trained beside the main model as
DeepSeek-V3 does (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 2.2): at position ``i`` it combines
the main model's final hidden state ``h_i`` with the embedding of token ``i + 1``
(``eh_proj([enorm(emb(x_{i+1})); hnorm(h_i)])``), runs one decoder layer over those and predicts token ``i + 2``
through its own norm and head. Its loss is added with weight ``MTP_LOSS_WEIGHT``. The layer is written where
DeepSeek ships it, under ``model.layers.{num_hidden_layers}.`` (``enorm``, ``hnorm``, ``eh_proj``,
``embed_tokens``, ``shared_head.norm``, ``shared_head.head`` and the decoder layer's own names), with
``num_nextn_predict_layers: 1`` in ``config.json``; transformers and raymoe's plain decoding ignore it. With
``mtp_distill_steps`` the layer is then trained alone on the trained model's own greedy text
(``raymoe.models.draft_distill``), which is what its drafts are checked against.

Weights go back under the checkpoint's own names (transformers fuses each layer's experts into ``gate_up_proj`` /
``down_proj`` tensors; they are split per expert again, a mapping checked to reproduce the untrained tensors
exactly before training starts). ``train_log.json`` in the folder records the loss curve and the final losses.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from raymoe.models.draft_distill import NEW_TOKENS, PROMPT_LEN, DraftLogits, distill_draft

MTP_LOSS_WEIGHT = 0.3
"""Weight of the MTP layer's loss next to the main loss (DeepSeek-V3's value for its first 10 T tokens)."""
DISTILL_LR = 1e-3
"""Peak learning rate of a draft model's distillation on the target's greedy text."""
DISTILL_POOL = 768
"""Greedy continuations (64 prompt + 192 generated tokens each) the distillation trains on."""


@dataclass
class TrainReport:
    """What a training run did (written to ``train_log.json``).

    Attributes:
        steps: optimizer steps. seconds: wall time of the loop. tokens: training tokens seen.
        losses: ``(step, main loss)`` every ``log_every`` steps, natural log units per token.
        final_loss: mean main loss over the last 10 steps. final_mtp_loss: the MTP layer's (None without one).
        skipped_steps: steps whose loss or gradient was not finite (no update made).
        distill_steps: steps of the draft model's (MTP layer's, EAGLE head's) distillation on the target's greedy
            text (``raymoe.models.draft_distill``; 0: none). final_distill_loss: its mean loss over the last 10.
        draft_agreement: the draft model's agreement with the target's next-next greedy token on held-out greedy
            text, before and after the distillation (the acceptance rate of one greedy draft on that text).
    """

    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)
    final_loss: float = float("nan")
    final_mtp_loss: float | None = None
    skipped_steps: int = 0
    distill_steps: int = 0
    final_distill_loss: float | None = None
    draft_agreement: tuple[float, float] | None = None


class TrainLoop:
    """What both trainers share: the budget (``steps``, else ``seconds`` of wall time), the learning-rate schedule
    (linear warm-up over the first 5 %, cosine decay to 10 % of ``lr``), the optimizer step with gradient clipping,
    the loss record and the progress bar showing the loss."""

    def __init__(self, name: str, seconds: float, steps: int | None, lr: float, params: list, tokens_per_step: int,
                 log_every: int, progress: bool):
        from tqdm.auto import tqdm

        if steps is None and not seconds > 0 or steps is not None and steps < 1:
            raise ValueError(f"training {name} needs seconds > 0 or steps >= 1")
        self.seconds, self.steps, self.lr, self.params = seconds, steps, lr, params
        self.opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
        self.tokens_per_step, self.log_every = tokens_per_step, log_every
        self.report, self.recent = TrainReport(), []
        self.bar = tqdm(total=steps if steps is not None else round(seconds), desc=f"raymoe: training {name}",
                        unit="step" if steps is not None else "s", disable=not progress)
        self.t0 = time.perf_counter()

    def next(self) -> bool:
        """Whether the budget allows another step (and set its learning rate)."""
        r = self.report
        frac = r.steps / self.steps if self.steps is not None else (time.perf_counter() - self.t0) / self.seconds
        if frac >= 1.0:
            return False
        lr = self.lr * (frac / 0.05 if frac < 0.05 else 0.1 + 0.45 * (1 + math.cos(math.pi * (frac - 0.05) / 0.95)))
        for g in self.opt.param_groups:
            g["lr"] = lr
        return True

    def step(self, loss: torch.Tensor, logged: float) -> None:
        """Back-propagate ``loss``, clip to norm 1, step; record ``logged`` (the loss the report shows). A step whose
        loss or gradient is not finite is skipped (its update would turn every weight into NaN), counted in
        ``TrainReport.skipped_steps``."""
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        if not (torch.isfinite(norm) and torch.isfinite(loss)):
            self.opt.zero_grad(set_to_none=True)
            self.report.skipped_steps += 1
            self.report.steps += 1
            return
        self.opt.step()
        r = self.report
        r.steps += 1
        r.tokens += self.tokens_per_step
        self.recent = (self.recent + [logged])[-10:]
        if r.steps % self.log_every == 0 or r.steps == 1:
            r.losses.append((r.steps, logged))
        self.bar.set_postfix(loss=f"{sum(self.recent) / len(self.recent):.3f}")
        self.bar.n = r.steps if self.steps is not None else min(round(time.perf_counter() - self.t0), self.bar.total)
        self.bar.refresh()

    def finish(self) -> TrainReport:
        """The report, with the wall time and the mean loss of the last 10 steps."""
        self.bar.close()
        self.report.seconds = time.perf_counter() - self.t0
        self.report.final_loss = sum(self.recent) / len(self.recent) if self.recent else float("nan")
        return self.report


def init_fused_experts(module: nn.Module, std: float) -> None:
    """Draw every matrix of ``module`` that no ``nn.Linear`` owns (transformers' fused expert tensors
    ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] and the router's ``weight`` [E, H]; norms hold vectors)
    from N(0, ``std``), in place. transformers creates the fused expert tensors with ``torch.empty`` and fills them
    only inside ``from_pretrained``; a layer built on its own would otherwise train from whatever the allocator
    handed back (sometimes NaN, so every step's gradient was non-finite)."""
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, nn.Linear):
                continue
            for param in sub.parameters(recurse=False):
                if param.dim() >= 2:
                    param.normal_(0.0, std)


class MTPLayer(nn.Module):
    """DeepSeek-V3's multi-token-prediction module for training (module docstring). ``decoder`` is a
    transformers ``DeepseekV3DecoderLayer``; the embedding is the main model's, the head starts as a copy of its."""

    def __init__(self, config, layer_idx: int, lm_head: nn.Linear):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        h = config.hidden_size
        self.enorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.decoder = DeepseekV3DecoderLayer(config, layer_idx)
        self.head_norm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.head = nn.Linear(h, config.vocab_size, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(lm_head.weight)
        init_fused_experts(self.decoder, config.initializer_range)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, position_embeddings, mask) -> torch.Tensor:
        """``hidden`` [B, S, H] the main model's final hidden states, ``next_embeds`` [B, S, H] the embeddings of
        the tokens one position later -> logits [B, S, V] of the tokens two positions later."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        x = self.decoder(x, attention_mask=mask, position_embeddings=position_embeddings)
        if isinstance(x, tuple):
            x = x[0]
        return self.head(self.head_norm(x))

    def checkpoint_tensors(self, prefix: str, embed: torch.Tensor) -> dict[str, torch.Tensor]:
        """The layer's tensors under DeepSeek's names below ``prefix`` (``model.layers.{L}.``)."""
        out = {prefix + "enorm.weight": self.enorm.weight, prefix + "hnorm.weight": self.hnorm.weight,
               prefix + "eh_proj.weight": self.eh_proj.weight, prefix + "embed_tokens.weight": embed,
               prefix + "shared_head.norm.weight": self.head_norm.weight,
               prefix + "shared_head.head.weight": self.head.weight}
        out.update(split_experts({prefix + k: v for k, v in self.decoder.state_dict().items()}))
        return out


def mtp_logits(hf, mtp: MTPLayer, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The MTP layer's logits [B, S-1, V] over ``ids`` [B, S] and the main model's final hidden states ``hidden``
    [B, S, H]: position ``i`` reads ``hidden[:, i]`` and ``ids[:, i + 1]`` at rotary position ``i + 1``."""
    batch, seq = ids.shape
    pos = torch.arange(1, seq, dtype=torch.int64)[None].expand(batch, -1)
    mask = torch.full((seq - 1, seq - 1), float("-inf")).triu(1)[None, None]
    return mtp(hidden[:, :-1], hf.model.embed_tokens(ids[:, 1:]), hf.model.rotary_emb(hidden, pos), mask)


def distill_into(report: TrainReport, hf, draft: nn.Module, logits_of: DraftLogits, data: torch.Tensor, *, name: str,
                 steps: int, pool_size: int, seed: int, batch_size: int, log_every: int, progress: bool) -> None:
    """Train ``draft`` ``steps`` more steps on ``hf``'s greedy text at ``DISTILL_LR``
    (``raymoe.models.draft_distill.distill_draft``; ``logits_of`` scores it, progress bar ``name``) and record it
    in ``report``: ``draft_agreement``, ``distill_steps``, ``final_distill_loss``, its wall time added to
    ``seconds``."""
    loop = TrainLoop(name, 0.0, steps, DISTILL_LR, list(draft.parameters()),
                     batch_size * (PROMPT_LEN + NEW_TOKENS - 1), log_every, progress)
    report.draft_agreement = distill_draft(hf, draft, logits_of, data, loop, pool_size=pool_size, seed=seed,
                                           batch_size=batch_size)
    done = loop.finish()
    report.distill_steps, report.final_distill_loss = done.steps, done.final_loss
    report.seconds += done.seconds


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``
    [E, H, I]) as the per-expert checkpoint names (``mlp.experts.{e}.{gate,up,down}_proj.weight``); other tensors
    unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def corpus_ids(tokenizer, eos_id: int) -> torch.Tensor:
    """The tokenizer's training corpus (the standard library's source) as one int64 token stream, files separated
    by ``eos_id``."""
    from raymoe.models.tokenizer_builder import _training_files, _training_texts

    ids: list[int] = []
    for text in _training_texts(_training_files()):
        ids += tokenizer.encode(text)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def train_checkpoint(folder: str | Path, seconds: float, *, steps: int | None = None, seed: int = 0,
                     seq_len: int = 128, batch_size: int = 16, lr: float = 3e-3, progress: bool = True,
                     log_every: int = 10, mtp_distill_steps: int = 0,
                     mtp_distill_pool: int = DISTILL_POOL) -> TrainReport:
    """Train the checkpoint in ``folder`` in place (module docstring) and return what it did.

    Args:
        folder: a folder written by ``make_checkpoint`` (``qwen3_moe``, ``deepseek_v3``, ``deepseek_v2`` or
            ``mixtral``; DeepSeek-V3 also gets its MTP layer).
        seconds: wall-clock budget of the training loop, seconds (ignored with ``steps``).
        steps: train exactly this many optimizer steps instead (reproducible across machines).
        seed: seed of the batch order and of the MTP layer's initialization.
        seq_len, batch_size: tokens per training window and windows per step. lr: AdamW's peak learning rate
            (linear warm-up over the first 5 % of the budget, cosine decay to 10 % of it).
        progress: a tqdm bar showing the loss.
        mtp_distill_steps: DeepSeek-V3 only: then train the MTP layer alone this many steps on the trained target's
            greedy continuations of ``mtp_distill_pool`` corpus prompts (``raymoe.models.draft_distill``), at
            ``DISTILL_LR``; 0: no distillation.
    Raises:
        ValueError: the folder's architecture cannot be trained here, or the budget is not positive.
    """
    from transformers import AutoModelForCausalLM

    from raymoe.tokenizer import load_tokenizer

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    if cfg["model_type"] not in ("qwen3_moe", "deepseek_v3", "deepseek_v2", "mixtral"):
        raise ValueError(f"training is not supported for {cfg['model_type']!r}")
    if steps is None and not seconds > 0 or steps is not None and steps < 1:
        raise ValueError("train_checkpoint needs seconds > 0 or steps >= 1")
    if mtp_distill_steps < 0 or mtp_distill_pool < 1:
        raise ValueError("train_checkpoint needs mtp_distill_steps >= 0 and mtp_distill_pool >= 1")
    weights_file = folder / "model.safetensors"
    original = load_file(str(weights_file))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    mapped = split_experts(hf.state_dict())
    if set(mapped) != set(original) or any(not torch.equal(mapped[k], original[k]) for k in original):
        raise ValueError("transformers' tensors do not map back onto the checkpoint's names")
    hf.train()
    router_aux = cfg["model_type"] in ("qwen3_moe", "mixtral")
    torch.manual_seed(seed)
    mtp = None
    if cfg["model_type"] == "deepseek_v3":
        mtp = MTPLayer(hf.config, cfg["num_hidden_layers"], hf.lm_head)
        mtp.train()
    params = list(hf.parameters()) + (list(mtp.parameters()) if mtp is not None else [])
    tok = load_tokenizer(str(folder))
    eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], int) else cfg["eos_token_id"][0]
    data = corpus_ids(tok, eos)
    gen = torch.Generator().manual_seed(seed)
    loop = TrainLoop(folder.name, seconds, steps, lr, params, batch_size * seq_len, log_every, progress)
    recent_mtp: list[float] = []
    while loop.next():
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
        ids = torch.stack([data[s:s + seq_len] for s in starts.tolist()])
        target = torch.stack([data[s + 1:s + seq_len + 1] for s in starts.tolist()])
        if router_aux:  # Qwen3-MoE, Mixtral: their load-balancing loss keeps every expert in use
            out = hf(input_ids=ids, output_router_logits=True)
            loss_main = nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())
            loss = loss_main + hf.config.router_aux_loss_coef * out.aux_loss
        else:  # DeepSeek: routing balanced by its gate's bias, not a loss
            hidden = hf.model(input_ids=ids).last_hidden_state
            loss_main = nn.functional.cross_entropy(hf.lm_head(hidden).flatten(0, 1), target.flatten())
            loss = loss_main
        if mtp is not None:  # position i: h_i and emb(x_{i+1}) -> x_{i+2}
            logits = mtp_logits(hf, mtp, ids, hidden)
            loss_mtp = nn.functional.cross_entropy(logits.flatten(0, 1), target[:, 1:].flatten())
            loss = loss + MTP_LOSS_WEIGHT * loss_mtp
            recent_mtp = (recent_mtp + [loss_mtp.item()])[-10:]
        loop.step(loss, loss_main.item())
    report = loop.finish()
    report.final_mtp_loss = sum(recent_mtp) / len(recent_mtp) if recent_mtp else None
    if mtp is not None and mtp_distill_steps > 0:
        distill_into(report, hf, mtp, lambda i, h: mtp_logits(hf, mtp, i, h), data,
                     name=f"{folder.name} MTP on its greedy text", steps=mtp_distill_steps, pool_size=mtp_distill_pool,
                     seed=seed, batch_size=batch_size, log_every=log_every, progress=progress)
    with torch.no_grad():
        tensors = {k: v.detach().contiguous() for k, v in split_experts(hf.state_dict()).items() if k in original}
        if mtp is not None:
            prefix = f"model.layers.{cfg['num_hidden_layers']}."
            embed = hf.model.embed_tokens.weight
            tensors.update({k: v.detach().clone().contiguous()
                            for k, v in mtp.checkpoint_tensors(prefix, embed).items()})
            cfg["num_nextn_predict_layers"] = 1
            (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
    (folder / "train_log.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report
