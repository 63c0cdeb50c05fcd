"""Normal-mode ``dispatch`` / ``combine`` of the DeepEP double (``deep_ep_double``), over gloo: the intranode kernels
and what the internode ones (``deep_ep_double_internode``) share with them.

Layouts follow DeepEP v1.2.1's intranode kernels: a token goes once to every rank that owns one of its experts;
received tokens are grouped by source rank (rank order), each source's in token order; ``recv_topk_idx`` holds
the receiving rank's local expert ids and -1 for other ranks' experts (weights 0 there); the handle is
``(rank_prefix_matrix [ranks, ranks] int32, channel_prefix_matrix [ranks, C] int32, recv_channel_prefix_matrix
[ranks, C] int32, recv_src_idx [R] int32, is_token_in_rank [N, ranks] bool, send_head [N, ranks] int32)`` with
C = ``config.num_sms // 2``. ``combine`` sends each received token's row back and sums the rows per token in
float32 (no weights), as DeepEP does.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from deep_ep_double_core import (
    DISPATCH_TMA_BYTES_PER_WARP,
    INTERNODE_MAX_TOPK,
    INTRANODE_MAX_TOPK,
    INTRANODE_RANKS,
    NOTIFY_MAX_LOCAL_EXPERTS,
    NUM_MAX_LOCAL_EXPERTS,
    check,
    check_expert_ids,
    deliver,
    pending,
)
from deep_ep_double_graph import library_call


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[n, ...] -> [n, bytes] uint8 view of ``t`` (n may be 0)."""
    return t.contiguous().reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def _unpack(buf: torch.Tensor, widths: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Split uint8 rows [n, B] into tensors [n, w] of the given (dtype, w) columns."""
    out, col = [], 0
    for dtype, w in widths:
        nb = w * dtype.itemsize
        out.append(buf.new_empty((buf.shape[0], nb)).copy_(buf[:, col:col + nb]).view(dtype).view(buf.shape[0], w))
        col += nb
    return out


class NormalModeMixin:
    """``Buffer.dispatch`` / ``Buffer.combine`` (non-cached, BF16-or-``limits`` rows): the intranode kernels here,
    the internode ones (more than 8 ranks) in ``deep_ep_double_internode``, as ``deep_ep/buffer.py`` branches."""

    @library_call("dispatch", capturable=False)
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, EventOverlap)."""
        config = self.get_dispatch_config(self.group_size) if config is None else config
        internode = self.num_rdma_ranks > 1
        if internode:
            assert num_worst_tokens == 0, "Internode dispatch does not support `num_worst_tokens > 0`"
        if isinstance(x, tuple) or handle is not None or num_worst_tokens:
            raise NotImplementedError("the double models non-cached BF16 dispatch without num_worst_tokens")
        self._stream_args(previous_event, async_finish, allocate_on_comm_stream)
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        if internode:
            check(num_tokens_per_rdma_rank is not None, "num_tokens_per_rdma_rank (internode)")
        else:
            check(self.group_size in INTRANODE_RANKS,
                  f"Unsupported ranks {self.group_size} (intranode kernels: {INTRANODE_RANKS})")
        el, k = self._check_dispatch_args(x, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, topk_idx,
                                          topk_weights, internode)
        if internode:
            return self._internode_dispatch(config, x, num_tokens_per_rdma_rank, is_token_in_rank,
                                            num_tokens_per_expert, topk_idx, topk_weights, el, k, expert_alignment,
                                            async_finish)
        ranks, me, n = self.group_size, self.rank, x.shape[0]
        h, es = x.shape[1], x.element_size()
        check(h * es % 32 == 0 and h * es // 2 + 8 <= DISPATCH_TMA_BYTES_PER_WARP,
              f"hidden {h} x {es} bytes: the dispatch's TMA copies halves of 16-byte multiples of at most 8 KiB")
        check(el <= NOTIFY_MAX_LOCAL_EXPERTS, f"{el} local experts > {NOTIFY_MAX_LOCAL_EXPERTS}")
        channels, chunk = config.num_sms // 2, config.num_max_nvl_chunked_recv_tokens
        check(ranks * (ranks + el) * 4 <= self.num_nvl_bytes, "num_nvl_bytes (notify)")
        check(ranks * ranks * 4 + channels * ranks * 16 + channels * ranks * chunk * (h * es + 4 + k * 12)
              <= self.num_nvl_bytes, "num_nvl_bytes too small for this hidden size / top-k")
        self._mark_normal_used()
        e = num_tokens_per_expert.numel()
        per_channel = -(-n // channels) if n else 1
        chan_counts = torch.stack([torch.bincount(torch.arange(n)[is_token_in_rank[:, d]] // per_channel,
                                                  minlength=channels) for d in range(ranks)])      # [dst, C]
        mine = torch.cat([num_tokens_per_rank.long(), num_tokens_per_expert.long(), chan_counts.flatten()])
        table = [torch.empty_like(mine) for _ in range(ranks)]
        dist.all_gather(table, mine, group=self.group)                                # the host waits for counts
        table = torch.stack(table)                                                    # [src, ...]
        sent = table[:, :ranks]                                                       # [src, dst] tokens
        local = table[:, ranks + me * el:ranks + (me + 1) * el].sum(0)
        per_expert_list = [int(-(-c // expert_alignment) * expert_alignment) for c in local.tolist()]
        recv_chan = table[:, ranks + e:].view(ranks, ranks, channels)[:, me].cumsum(1).to(torch.int32)
        send_head = torch.full((n, ranks), -1, dtype=torch.int32)
        for d in range(ranks):
            tok = is_token_in_rank[:, d].nonzero(as_tuple=True)[0]
            send_head[tok, d] = torch.arange(tok.numel(), dtype=torch.int32)
        recv_x, recv_src_idx, recv_ids, recv_weights, event = self._post_tokens(
            x, topk_idx, topk_weights, is_token_in_rank, sent[:, me].tolist(), el, k, async_finish)
        handle = (sent.cumsum(0).to(torch.int32), chan_counts.cumsum(1).to(torch.int32), recv_chan, recv_src_idx,
                  is_token_in_rank, send_head)
        return recv_x, recv_ids, recv_weights, per_expert_list, handle, event

    def _check_dispatch_args(self, x, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, topk_idx,
                             topk_weights, internode: bool) -> tuple[int, int]:
        """The host checks both dispatch kernels share, and the double's layout check; returns (E_local, top-k)."""
        ranks, n = self.group_size, x.shape[0]
        h, es = x.shape[1], x.element_size()
        check(x.dim() == 2 and x.is_contiguous() and h * es % 16 == 0, "x: contiguous [N, H], H * itemsize % 16")
        check(is_token_in_rank.dtype == torch.bool and is_token_in_rank.dim() == 2 and is_token_in_rank.is_contiguous()
              and tuple(is_token_in_rank.shape) == (n, ranks), "is_token_in_rank: contiguous bool [N, ranks]")
        e = num_tokens_per_expert.numel()
        check(num_tokens_per_expert.dtype == torch.int32 and num_tokens_per_expert.dim() == 1
              and num_tokens_per_expert.is_contiguous() and e % ranks == 0 and e // ranks <= NUM_MAX_LOCAL_EXPERTS,
              "num_tokens_per_expert: contiguous int32 [E]")
        check(num_tokens_per_rank.dtype == torch.int32 and num_tokens_per_rank.dim() == 1
              and num_tokens_per_rank.is_contiguous() and tuple(num_tokens_per_rank.shape) == (ranks,),
              "num_tokens_per_rank: contiguous int32 [ranks]")
        check((topk_idx is None) == (topk_weights is None), "topk_idx and topk_weights go together")
        k = 0
        if topk_idx is not None:
            k = topk_idx.shape[1]
            check(topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == torch.int64
                  and topk_idx.shape[0] == n, "topk_idx")
            check(topk_weights.is_contiguous() and tuple(topk_weights.shape) == (n, k)
                  and topk_weights.dtype == torch.float32, "topk_weights: float32 [N, k]")
            limit, kernels = (INTERNODE_MAX_TOPK, "internode") if internode else (INTRANODE_MAX_TOPK, "intranode")
            check(k <= limit, f"num_topk {k} > {limit} of the {kernels} kernels")
            check_expert_ids(topk_idx, e)
            from deep_ep_double import _layout

            per_expert, in_rank = _layout(topk_idx, e, ranks)
            check(torch.equal(per_expert, num_tokens_per_expert) and torch.equal(in_rank, is_token_in_rank)
                  and torch.equal(in_rank.sum(0, dtype=torch.int32), num_tokens_per_rank),
                  "the layout tensors do not describe topk_idx (get_dispatch_layout of the same topk_idx)")
        return e // ranks, k

    def _post_tokens(self, x, topk_idx, topk_weights, is_token_in_rank, recv_from: list[int], el: int, k: int,
                     async_finish: bool, also=()):
        """Send each token once to every rank it goes to (its top-k ids made the receiver's local ids, -1 for
        other ranks' experts, weight 0 there); received rows are grouped by source rank, each source's in token
        order. Returns (recv_x [R, H], recv_src_idx [R] int32, recv_topk_idx [R, k] int64 | None,
        recv_topk_weights [R, k] float32 | None, EventOverlap), the tensors unreceived until the event's wait, as
        are the handle tensors ``also`` (pending aliases the caller filled)."""
        ranks, h = self.group_size, x.shape[1]
        tokens, ids = [], []
        for d in range(ranks):
            tok = is_token_in_rank[:, d].nonzero(as_tuple=True)[0]
            tokens.append(tok)
            if k:
                lid = topk_idx[tok] - d * el
                ids.append(torch.where((lid >= 0) & (lid < el), lid, -1))
        tok = torch.cat(tokens)
        cols = [_bytes(x[tok]), _bytes(tok.to(torch.int32).view(-1, 1))]
        if k:
            lid = torch.cat(ids)
            cols += [_bytes(lid), _bytes(torch.where(lid >= 0, topk_weights[tok], 0.0))]
        send = torch.cat(cols, dim=1)
        r = sum(recv_from)
        recv = send.new_empty((r, send.shape[1]))
        send_to = [t.numel() for t in tokens]
        work = dist.all_to_all_single(recv, send, recv_from, send_to, group=self.group, async_op=True)
        outs = [torch.empty(r, h, dtype=x.dtype), torch.empty(r, dtype=torch.int32)]
        widths = [(x.dtype, h), (torch.int32, 1)]
        if k:
            outs += [torch.empty(r, k, dtype=torch.int64), torch.empty(r, k, dtype=torch.float32)]
            widths += [(torch.int64, k), (torch.float32, k)]
        aliases = [pending(o, "dispatch, async_finish") for o in outs]

        def on_wait():
            for o, part in zip(outs, _unpack(recv, widths), strict=True):
                o.copy_(part.view(o.shape))
            deliver(*aliases, *also)

        event = self._event(async_finish, [work], on_wait)
        recv_ids, recv_weights = (aliases[2], aliases[3]) if k else (None, None)
        return aliases[0], aliases[1], recv_ids, recv_weights, event

    @library_call("combine")
    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(combined_x [N, H], combined_topk_weights [N, k] float32 or None, EventOverlap): the sum over ranks
        of the rows sent back for each token (no weights applied)."""
        config = self.get_combine_config(self.group_size) if config is None else config
        if self.num_rdma_ranks > 1:
            return self._internode_combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                           allocate_on_comm_stream)
        if bias is not None:
            raise NotImplementedError("the double does not model the combine bias")
        self._stream_args(previous_event, async_finish, allocate_on_comm_stream)
        rank_prefix, _, channel_prefix, src_idx, _, send_head = handle
        ranks, me = self.group_size, self.rank
        channels, chunk = config.num_sms // 2, config.num_max_nvl_chunked_recv_tokens
        r, h, es = x.shape[0], x.shape[1], x.element_size()
        check(ranks in INTRANODE_RANKS, f"Unsupported ranks {ranks} (intranode kernels: {INTRANODE_RANKS})")
        check(x.dim() == 2 and x.is_contiguous() and h * es % 16 == 0, "x: contiguous [R, H]")
        check(x.dtype in self.limits.dtypes, f"Unsupported type {x.dtype} (the combine kernels take bfloat16)")
        check(src_idx.dtype == torch.int32 and src_idx.dim() == 1 and src_idx.is_contiguous() and src_idx.size(0) == r,
              "x must have one row per received token of the handle")
        check(send_head.dtype == torch.int32 and send_head.dim() == 2 and send_head.is_contiguous()
              and send_head.size(1) == ranks, "send_head")
        check(all(t.dtype == torch.int32 and t.dim() == 2 and t.is_contiguous() for t in (rank_prefix, channel_prefix)),
              "rank_prefix_matrix / channel_prefix_matrix: contiguous int32")
        check(tuple(rank_prefix.shape) == (ranks, ranks) and tuple(channel_prefix.shape) == (ranks, channels),
              "handle shapes (dispatch and combine configs must have the same num_sms)")
        k = self._check_combine_weights(topk_weights, r, INTRANODE_MAX_TOPK, "intranode")
        check(channels * ranks * 8 + channels * ranks * chunk * (h * es + 4 + k * 4) <= self.num_nvl_bytes,
              "num_nvl_bytes too small for the combine")
        self._mark_normal_used()
        src_idx.sum()  # the rows' sources must have arrived (raises on an unreceived dispatch)
        col = rank_prefix[:, me].long()
        recv_from = (col - torch.cat([col.new_zeros(1), col[:-1]])).tolist()
        back_tokens = []
        for d in range(ranks):
            slots = send_head[:, d]
            tok = (slots >= 0).nonzero(as_tuple=True)[0]
            back_tokens.append(tok[torch.argsort(slots[tok])])
        return self._post_rows(x, topk_weights, recv_from, back_tokens, send_head.shape[0], async_finish)

    @staticmethod
    def _check_combine_weights(topk_weights, r: int, max_topk: int, kernels: str) -> int:
        """The combine's top-k weight checks; returns k (0 without weights)."""
        if topk_weights is None:
            return 0
        check(topk_weights.dim() == 2, "topk_weights: float32 [R, k]")
        k = topk_weights.shape[1]
        check(topk_weights.is_contiguous() and topk_weights.shape[0] == r and topk_weights.dtype == torch.float32,
              "topk_weights: float32 [R, k]")
        check(k <= max_topk, f"num_topk {k} > {max_topk} of the {kernels} kernels")
        return k

    def _post_rows(self, x, topk_weights, send_counts: list[int], back_tokens: list[torch.Tensor], n: int,
                   async_finish: bool):
        """Send the received rows ``x`` [R, H] (and ``topk_weights`` [R, k]) back to their sources, ``send_counts[s]``
        rows to rank ``s`` in order, and sum in float32 what comes back per token: the rows from rank ``d`` belong
        to the tokens ``back_tokens[d]``, in that order. Returns (combined_x [n, H], combined weights [n, k] or
        None, EventOverlap)."""
        h, k = x.shape[1], (0 if topk_weights is None else topk_weights.shape[1])
        cols = [_bytes(x)] + ([_bytes(topk_weights)] if k else [])
        send = torch.cat(cols, dim=1)
        sizes = [t.numel() for t in back_tokens]
        back = send.new_empty((sum(sizes), send.shape[1]))
        work = dist.all_to_all_single(back, send, sizes, send_counts, group=self.group, async_op=True)
        out_x, out_w = torch.empty(n, h, dtype=x.dtype), torch.empty(n, k, dtype=torch.float32)
        aliases = [pending(out_x, "combine, async_finish")] + ([pending(out_w, "combine, async_finish")] if k else [])

        def on_wait():
            widths = [(x.dtype, h)] + ([(torch.float32, k)] if k else [])
            parts = _unpack(back, widths)
            acc = [torch.zeros(n, h, dtype=torch.float32), torch.zeros(n, k, dtype=torch.float32)]
            start = 0
            for tok in back_tokens:
                for a, p in zip(acc, parts, strict=False):
                    a.index_add_(0, tok, p[start:start + tok.numel()].float())
                start += tok.numel()
            out_x.copy_(acc[0])
            out_w.copy_(acc[1])
            deliver(*aliases)

        event = self._event(async_finish, [work], on_wait)
        return aliases[0], (aliases[1] if k else None), event
