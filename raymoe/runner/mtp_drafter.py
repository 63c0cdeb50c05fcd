"""Drafting with a draft model on the rank (``speculative_algorithm`` ``nextn`` or ``eagle``), after every step.

The draft model is DeepSeek's MTP layer (``raymoe.models.deepseek_mtp``) or an EAGLE head
(``raymoe.models.eagle_head``): one decoder layer that reads the target's hidden state at a position and the next
token's embedding, with its own KV cache layer. After the target's forward and its sampling (or verification) of a
step, the rank runs it twice over (the "MTP layer" below is either):

1. **Draft extend**: over every position whose token the step made final, the MTP layer reads the target's hidden
   state there and the token that follows it: the next prompt token inside a prefill chunk, the next draft for an
   accepted draft, the row's sampled token at its last position. A verify row covers its newest token and its
   accepted drafts only (``accept_lens``). This writes the layer's KV for those positions (cache layer
   ``num_hidden_layers``), so the layer's own attention always sees the request's true prefix; its output at a
   sampling row's last position gives the first draft (greedy) and the hidden state for the next.
2. **Draft chain**: ``speculative_num_steps - 1`` decode passes, each feeding the previous draft and the layer's
   own output hidden state at the next position, in the step's scratch KV slots
   (``ModelWorkerBatch.spec_scratch_slots``; without them the chain stops at one draft).

Every rank runs both, with the same number of passes (IDLE ranks and ranks without sampling rows run them with no
tokens), so the MTP layer's MoE collectives pair up across the expert-parallel group; eager passes use the normal
dispatch without two-batch overlap. Drafts are greedy (a point-mass draft distribution), which the verify step's
rejection sampling takes as it is (``raymoe.runner.spec_verify``). The accepted counts of a verify step are read
on the host here (one sync per step).

**Decode graphs of the passes** (:meth:`MtpDrafter.capture_graphs`): every pass with one token per row is a decode
of the MTP layer, captured per bucket like the target's decode (the same sizes; the same attention backend and its
graph buffers; the low-latency dispatch where the target's graphs use it). A graph's inputs are its static batch,
the tokens, and the hidden states copied into a buffer of fixed address; it returns the layer's output hidden states
and the greedy drafts. Which passes replay is decided by the driver for all ranks alike, since the dispatch mode of
their MoE collectives must match: the chain passes replay bucket ``ModelWorkerBatch.draft_graph_bs`` (a bound of
every group's rows), and the draft extend, as one decode row per final position (``raymoe.runner.token_rows``),
replays bucket ``graph_bs`` on a step the target ran as a graph (a decode step, or a verify step as decode rows: its
tokens bound the final positions); ranks without rows replay the bucket with padding rows only. SGLang captures its
draft passes the same way (``EAGLEDraftCudaGraphRunner``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from raymoe.runner.forward_batch import ForwardBatch
from raymoe.runner.token_rows import token_rows
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.host_transfer import to_device
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch


class MtpDrafter:
    """Runs the MTP layer's passes of a step (module docstring).

    Args:
        draft: the draft model (``forward(fb, input_ids, hidden)``, ``logits(hidden)``).
        attn_backend: the rank's attention backend (its metadata is
            rebuilt for each pass). req_to_token_pool: the rank's table (the chain's scratch slots are written).
        num_steps: drafts per sampling row (``speculative_num_steps``). ops: the rank's platform. device: the rank's.
    """

    def __init__(self, draft, attn_backend, req_to_token_pool, num_steps: int, ops, device: torch.device):
        self.mtp = draft
        self.attn_backend = attn_backend
        self.req_to_token_pool = req_to_token_pool
        self.num_steps = num_steps
        self.ops = ops
        self.device = device
        self.graphs = None  # a GraphRunner of the decode passes (capture_graphs)
        self._hidden_in: torch.Tensor | None = None  # [max_bs, H] the graphs' hidden-state input
        self.graph_passes = 0  # passes replayed from a graph
        self.eager_passes = 0

    def capture_graphs(self, make_runner: Callable, hidden_size: int, dtype: torch.dtype, max_bs: int) -> None:
        """Capture the decode passes (module docstring).

        Args:
            make_runner: ``forward_fn -> GraphRunner`` over this rank's buckets (``ModelRunner.build_graph_runner``
                builds it beside the target's graphs, sharing the attention backend's graph buffers).
            hidden_size: H of the hidden states. dtype: theirs. max_bs: the largest bucket, rows.
        """
        self._hidden_in = torch.zeros(max_bs, hidden_size, dtype=dtype, device=self.device)

        def forward(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
            g = self.mtp(fb, fb.input_ids, self._hidden_in[:fb.batch_size])
            return g, self.ops.greedy_argmax(self.mtp.logits(g, fb.batch_size))

        self.graphs = make_runner(forward)

    def _pass(self, wb: ModelWorkerBatch, ids: torch.Tensor, hidden: torch.Tensor,
              pick: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the MTP layer over ``wb`` (its table written): ``ids`` [T], ``hidden`` [T, H] -> the output
        hidden states and greedy drafts of the rows ``pick`` selects (None: every row). A ``wb`` with ``graph_bs``
        (one token per row) replays that bucket's graph, else the pass runs eagerly."""
        if wb.graph_bs is not None and self.graphs is not None:
            fb = ForwardBatch.from_worker_batch(wb, self.device, SamplingInputs.greedy(wb.batch_size))
            fb.input_ids = ids
            fb.attn_backend = self.attn_backend
            if wb.batch_size:
                self._hidden_in[:wb.batch_size].copy_(hidden)
            g, d = self.graphs.replay(fb)
            self.graph_passes += 1
            if pick is not None:
                return g[pick], d[pick]
            return g, d.clone()  # CUDA: views of the graphs' outputs, rewritten by the next replay
        out = self.mtp(self._fb(wb), ids, hidden)
        g = out if pick is None else out[pick]
        self.eager_passes += 1
        return g, self._logits_argmax(g)

    def _fb(self, wb: ModelWorkerBatch) -> ForwardBatch:
        fb = ForwardBatch.from_worker_batch(wb, self.device, SamplingInputs.greedy(wb.batch_size))
        fb.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(fb)
        return fb

    def _logits_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.greedy_argmax(self.mtp.logits(hidden))

    @torch.inference_mode()
    def draft(self, batch: ModelWorkerBatch, input_ids: torch.Tensor, hidden: torch.Tensor, next_ids: list[int],
              accept_lens: list[int] | None) -> list[tuple[int, ...]]:
        """The step's drafts: per row of ``batch``, ``num_steps`` draft tokens (fewer without scratch slots) for a
        row that sampled, ``()`` for a prefill chunk that did not.

        Args:
            batch: the step as the rank received it (its table already written).
            input_ids: [T] the step's resolved input ids. hidden: [T, H] the target's final hidden states.
            next_ids: ``bs`` host ids the rows sampled (a verify row's own token after its accepted drafts).
            accept_lens: a verify step's accepted drafts per row (host), else None.
        """
        bs = batch.batch_size
        next_info = batch.spec_next_ids or (-1,) * bs
        rows, pre, ext, loc, src, follow, last = [], [], [], [], [], [], []
        start = 0
        verify_mode = batch.forward_mode == ForwardMode.TARGET_VERIFY
        for r in range(bs):
            e = batch.extend_lens[r]
            k = batch.draft_lens[r] if batch.draft_lens else (e - 1 if verify_mode else 0)
            n = e - k + accept_lens[r] if accept_lens is not None else e  # the positions the step made final
            p = batch.prefix_lens[r]
            rows.append(batch.req_pool_indices[r])
            pre.append(p)
            ext.append(n)
            loc += batch.out_cache_loc[start:start + n]
            src += range(start, start + n)
            nxt = next_ids[r] if next_info[r] < 0 else next_info[r]
            follow += [-1] * (n - 1) + [nxt]  # -1: the next input id of the step (shifted by one)
            if next_info[r] < 0:
                last.append((r, len(src) - 1))
            start += e
        tokens = len(src)
        # after a decode or verify step each row has a few new positions: decode rows, one per token (on MLA the
        # absorbed form, which reads the cached latent rows instead of up-projecting the whole prefix); on a graph
        # step (graph_bs is the driver's, the same on every rank) they replay the bucket that held the step's tokens
        if batch.graph_bs is not None:
            wb = token_rows(rows, pre, ext, loc, [0] * tokens, batch.graph_bs)
        else:
            few = batch.forward_mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
            mode = ForwardMode.TARGET_VERIFY if few else ForwardMode.EXTEND
            wb = ModelWorkerBatch(mode, [0] * tokens, rows, [p + n for p, n in zip(pre, ext, strict=True)],
                                  pre, ext, loc, table_lens=list(pre)) if bs else ModelWorkerBatch.idle()
        src_t = to_device(src, torch.int64, self.device)
        shifted = input_ids[(src_t + 1).clamp(max=max(input_ids.shape[0] - 1, 0))] if tokens else input_ids[:0]
        follow_t = to_device(follow, torch.int64, self.device)
        ids = torch.where(follow_t >= 0, follow_t, shifted) if tokens else shifted
        pick = to_device([i for _, i in last], torch.int64, self.device)
        g, d = self._pass(wb, ids, hidden[src_t], pick)
        drafts = [d]
        scratch = batch.spec_scratch_slots
        chain = self.num_steps - 1
        sample_rows = [r for r, _ in last]
        for i in range(chain):
            if scratch and sample_rows:
                pos = [pre[r] + ext[r] - 1 + i + 1 for r in sample_rows]  # the position each chain token lands at
                slots = [scratch[k * chain + i] for k in range(len(sample_rows))]
                rows_i = [rows[r] for r in sample_rows]
                wb = ModelWorkerBatch(ForwardMode.DECODE, [0] * len(rows_i), rows_i, [q + 1 for q in pos], pos,
                                      [1] * len(rows_i), slots, graph_bs=batch.draft_graph_bs)
                self.req_to_token_pool.write_decode(to_device(rows_i, torch.int64, self.device),
                                                    to_device([q + 1 for q in pos], torch.int64, self.device),
                                                    to_device(slots, torch.int64, self.device))
                g, d = self._pass(wb, drafts[-1], g)
                drafts.append(d)
            else:  # no chain this step on this rank: the pass still joins the MoE collectives
                idle = dataclasses.replace(ModelWorkerBatch.idle(), graph_bs=batch.draft_graph_bs)
                self._pass(idle, drafts[-1][:0], g[:0])
        host = torch.stack(drafts, dim=1).tolist() if sample_rows else []
        out_rows: list[tuple[int, ...]] = [()] * bs
        for k, r in enumerate(sample_rows):
            out_rows[r] = tuple(host[k])
        return out_rows
