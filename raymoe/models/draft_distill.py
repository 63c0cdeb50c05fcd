"""Distilling a draft model onto its target's own greedy text, so that its drafts are the tokens the target picks.

A greedy draft is accepted when it equals the target's argmax at that position (``raymoe.runner.spec_verify``), and
the text the target then continues is its own output, not the corpus. A draft layer trained on the corpus (the MTP
layer trained beside the main model in ``raymoe.models.train_demo``, an EAGLE head in ``raymoe.models.
train_eagle``) learns the corpus's token two positions ahead, which on a tiny model trained for minutes agrees with
the target's own choice about half the time. This second phase freezes the target, writes a pool of its greedy
continuations of corpus prompts (the workload ``raymoe bench spec`` decodes), and trains the draft model alone to
predict, at each position ``i``, the target's argmax after position ``i + 1`` (its hidden state ``h_i`` and the
token ``x_{i+1}`` in, as when drafting): on generated text that is exactly the next-next token. EAGLE (Li et al.,
2024) and Medusa (Cai et al., 2024) train their heads on target-generated data for the same reason
("self-distillation").

Measured on the trained DeepSeek-V3 demo (4 layers x hidden 128, 1500 steps), on held-out greedy text: agreement
of its MTP layer with the target 0.54 before, 0.76 after 1200 steps on 768 continuations
(``TrainReport.draft_agreement``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

PROMPT_LEN = 64
"""Corpus tokens each greedy continuation starts from."""
NEW_TOKENS = 192
"""Greedy tokens the target writes after each prompt."""

DraftLogits = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(ids [B, S] int64, target hidden [B, S, H] float32) -> logits [B, S-1, V]``: position ``i`` of the draft model
reads ``hidden[:, i]`` and ``ids[:, i + 1]`` and scores the token after ``ids[:, i + 1]``."""


@torch.no_grad()
def greedy_pool(hf, data: torch.Tensor, num: int, prompt_len: int, new_tokens: int, seed: int,
                batch: int = 16) -> torch.Tensor:
    """``num`` greedy continuations by the transformers model ``hf`` of seeded ``prompt_len``-token slices of
    ``data`` (an int64 token stream), ``new_tokens`` each, end of sequence not special: int64 [num, prompt_len +
    new_tokens]."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for b in range(0, num, batch):
        n = min(batch, num - b)
        starts = torch.randint(0, data.numel() - prompt_len - 1, (n,), generator=gen).tolist()
        ids = torch.stack([data[s:s + prompt_len] for s in starts])
        out = hf(input_ids=ids, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        seq = [ids, nxt]
        for _ in range(new_tokens - 1):
            out = hf(input_ids=nxt, cache=out.cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            seq.append(nxt)
        parts.append(torch.cat(seq, dim=1))
    return torch.cat(parts)


@torch.no_grad()
def target_view(hf, pool: torch.Tensor, batch: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target's final hidden states float32 [N, S, H] and greedy next tokens int64 [N, S] over
    ``pool`` [N, S]."""
    hidden, labels = [], []
    for b in range(0, pool.size(0), batch):
        h = hf.model(input_ids=pool[b:b + batch]).last_hidden_state
        hidden.append(h)
        labels.append(hf.lm_head(h).argmax(-1))
    return torch.cat(hidden), torch.cat(labels)


@torch.no_grad()
def agreement(draft: nn.Module, logits_of: DraftLogits, pool: torch.Tensor, hidden: torch.Tensor,
              labels: torch.Tensor, prompt_len: int) -> float:
    """Share of the generated positions of ``pool`` where the draft model's argmax is the target's next-next token
    (the acceptance rate of a one-token greedy draft on that text)."""
    was = draft.training
    draft.eval()
    pred = torch.cat([logits_of(pool[b:b + 32], hidden[b:b + 32]).argmax(-1) for b in range(0, pool.size(0), 32)])
    draft.train(was)
    return (pred[:, prompt_len - 1:] == labels[:, prompt_len:]).float().mean().item()


def distill_draft(hf, draft: nn.Module, logits_of: DraftLogits, data: torch.Tensor, loop, *, pool_size: int,
                  seed: int, prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS,
                  batch_size: int = 16) -> tuple[float, float]:
    """Train ``draft`` (scored by ``logits_of``) on ``hf``'s greedy text, ``hf`` frozen (module docstring), for the
    budget of ``loop`` (a ``train_demo.TrainLoop`` over ``draft``'s parameters).

    Returns: the agreement with the target on held-out greedy text (``agreement``) before and after.
    """
    hf.eval()
    hf.requires_grad_(False)
    pool = greedy_pool(hf, data, pool_size, prompt_len, new_tokens, seed)
    held = greedy_pool(hf, data, max(pool_size // 16, 4), prompt_len, new_tokens, seed + 1)
    hidden, labels = target_view(hf, pool)
    held_hidden, held_labels = target_view(hf, held)
    before = agreement(draft, logits_of, held, held_hidden, held_labels, prompt_len)
    gen = torch.Generator().manual_seed(seed)
    draft.train()
    while loop.next():
        idx = torch.randint(0, pool.size(0), (batch_size,), generator=gen)
        logits = logits_of(pool[idx], hidden[idx])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels[idx][:, 1:].flatten())
        loop.step(loss, loss.item())
    return before, agreement(draft, logits_of, held, held_hidden, held_labels, prompt_len)

