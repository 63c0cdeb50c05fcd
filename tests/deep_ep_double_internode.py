"""Internode normal-mode ``dispatch`` / ``combine`` of the DeepEP double (``deep_ep_double``): more than 8 ranks.

DeepEP v1.2.1 above ``NUM_MAX_NVL_PEERS`` = 8 ranks (``deep_ep.cpp`` ``Buffer::internode_dispatch`` /
``internode_combine``, ``csrc/kernels/internode.cu``): rank ``r`` is GPU ``r % 8`` of node ``r // 8`` (its RDMA
rank). A token travels over RDMA once to every node holding one of its experts, to the rank with the sender's GPU
index there, which forwards it over NVLink to the ranks of its node that need it. What a rank receives is laid out
as in the intranode kernels (``recv_gbl_rank_prefix_sum``: grouped by global source rank, each source's tokens in
order; top-k ids made the receiver's local ids, -1 and weight 0 elsewhere), so the double moves rows with the
intranode exchange (``NormalModeMixin._post_tokens`` / ``_post_rows``) and builds DeepEP's internode handle:

``(is_token_in_rank [N, ranks] bool, rdma_channel_prefix_matrix [nodes, C] int32, gbl_channel_prefix_matrix
[ranks, C] int32, recv_rdma_channel_prefix_matrix [nodes, C] int32, recv_rdma_rank_prefix_sum [nodes] int32,
recv_gbl_channel_prefix_matrix [ranks, C] int32, recv_gbl_rank_prefix_sum [ranks] int32, recv_src_meta [R, 8]
uint8, send_rdma_head [N, nodes] int32, send_nvl_head [R_rdma, 8] int32)``, C = ``config.num_sms // 2``, channel of
a token = its index // ceil(N / C). Prefix matrices are inclusive cumulative counts over channels (the received
global one: each channel's start offset), ``recv_src_meta`` is DeepEP's ``SourceMeta`` (source node, int32 bits of
the receiving node's ranks the token goes to), the heads are a token's slot in its channel's RDMA / NVLink queue
(-1: not sent there), taking arrivals in source-node order.

Refused as the library refuses (host asserts) or traps (device asserts): RDMA ranks outside ``SWITCH_RDMA_RANKS``,
a token for more than ``min(nodes, 8)`` nodes, top-k above 32, a token message over the 16 KiB TMA buffer, an NVLink
buffer below the kernels' clean region, queue pairs neither C nor ``>= num_sms`` (device assert of the dispatch,
``internode.cu``), configs the combine's forwarders
cannot use. Stricter than the library (it would read or write out of bounds): an RDMA buffer below
``Config.get_rdma_buffer_size_hint`` (the kernels lay out the buffer by the hint), layout tensors that do not
describe ``topk_idx``, combine rows that are not the dispatch's received rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deep_ep_double_core import (
    INTERNODE_COMBINE_FORWARDER_WARPS,
    INTERNODE_MAX_TOPK,
    INTERNODE_MAX_TOPK_NODES,
    INTERNODE_NOTIFY_THREADS,
    INTERNODE_RDMA_RANKS,
    INTERNODE_TMA_BYTES_PER_WARP,
    NUM_MAX_NVL_PEERS,
    NUM_MAX_RDMA_PEERS,
    SOURCE_META_BYTES,
    check,
    pending,
)


def _bytes_per_token(hidden_bytes: int, num_topk_idx: int, num_topk_weights: int) -> int:
    """``get_num_bytes_per_token`` (BF16 rows, no scales): hidden + SourceMeta + top-k ids and weights, 16-aligned."""
    n = hidden_bytes + SOURCE_META_BYTES + num_topk_idx * 4 + num_topk_weights * 4
    return -(-n // 16) * 16


def _channels(n: int, num_channels: int) -> torch.Tensor:
    """The channel of each of ``n`` tokens: DeepEP splits a rank's tokens into ``num_channels`` even runs."""
    per = -(-n // num_channels) if n else 1
    return torch.arange(n) // per


def in_node(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """[N, ranks] bool -> [N, ranks / 8] bool: whether a token goes to any rank of each node."""
    n, ranks = is_token_in_rank.shape
    return is_token_in_rank.view(n, ranks // NUM_MAX_NVL_PEERS, NUM_MAX_NVL_PEERS).any(-1)


def _channel_prefix(mask: torch.Tensor, chan: torch.Tensor, num_channels: int) -> torch.Tensor:
    """[N, D] bool -> [D, C] int32: per destination, the inclusive cumulative token count over channels."""
    counts = torch.stack([torch.bincount(chan[mask[:, d]], minlength=num_channels) for d in range(mask.shape[1])])
    return counts.cumsum(1).to(torch.int32)


def _slots(mask: torch.Tensor, chan: torch.Tensor, num_channels: int) -> torch.Tensor:
    """[N, D] bool -> [N, D] int32: a token's slot among its channel's tokens for each destination, else -1."""
    head = torch.full(mask.shape, -1, dtype=torch.int32)
    for d in range(mask.shape[1]):
        for c in range(num_channels):
            tok = (mask[:, d] & (chan == c)).nonzero(as_tuple=True)[0]
            head[tok, d] = torch.arange(tok.numel(), dtype=torch.int32)
    return head


class InternodeMixin:
    """``Buffer.internode_dispatch`` / ``internode_combine`` (needs ``NormalModeMixin`` and the ``Buffer`` fields:
    ``group``, ``rank``, ``group_size``, ``num_rdma_ranks``, ``num_nvl_bytes``, ``num_rdma_bytes``,
    ``num_qps_per_rank``, ``num_sms``, ``limits``)."""

    def _check_internode_buffers(self, config, hidden_bytes: int, bytes_per_token: int) -> int:
        """The RDMA-rank count, queue pairs and buffer sizes both internode kernels need; returns C."""
        nodes, channels = self.num_rdma_ranks, config.num_sms // 2
        check(config.num_sms % 2 == 0 and channels * 2 > 3, "config.num_sms")
        check(0 < nodes <= NUM_MAX_RDMA_PEERS, f"{nodes} RDMA ranks > NUM_MAX_RDMA_PEERS {NUM_MAX_RDMA_PEERS}")
        check(nodes in INTERNODE_RDMA_RANKS, f"Unsupported RDMA ranks {nodes} (internode kernels: "
                                             f"{INTERNODE_RDMA_RANKS} nodes of 8 ranks)")
        check(bytes_per_token + 8 <= INTERNODE_TMA_BYTES_PER_WARP,
              f"a token message of {bytes_per_token} bytes exceeds the kernels' TMA buffer")
        nvl_clean = (config.num_max_nvl_chunked_recv_tokens * bytes_per_token * NUM_MAX_NVL_PEERS * channels
                     + NUM_MAX_NVL_PEERS * (2 * nodes + 2) * channels * 4)
        check(nvl_clean <= self.num_nvl_bytes, "num_nvl_bytes below the internode kernels' clean region")
        check(config.get_rdma_buffer_size_hint(hidden_bytes, self.group_size) <= self.num_rdma_bytes,
              "num_rdma_bytes below Config.get_rdma_buffer_size_hint (the kernels lay the buffer out by the hint)")
        check(self.num_qps_per_rank == channels or self.num_qps_per_rank >= config.num_sms,
              f"num_qps_per_rank {self.num_qps_per_rank}: the internode kernels need {channels} or >= "
              f"{config.num_sms} queue pairs per peer")
        return channels

    def _internode_dispatch(self, config, x, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
                            topk_idx, topk_weights, el: int, k: int, expert_alignment: int, async_finish: bool):
        """``dispatch`` above 8 ranks, after the checks it shares with the intranode kernels."""
        ranks, nodes, me, n = self.group_size, self.num_rdma_ranks, self.rank, x.shape[0]
        check(num_tokens_per_rdma_rank.dtype == torch.int32 and num_tokens_per_rdma_rank.dim() == 1
              and num_tokens_per_rdma_rank.is_contiguous() and tuple(num_tokens_per_rdma_rank.shape) == (nodes,),
              "num_tokens_per_rdma_rank: contiguous int32 [ranks / 8]")
        to_node = in_node(is_token_in_rank)
        check(torch.equal(to_node.sum(0, dtype=torch.int32), num_tokens_per_rdma_rank),
              "num_tokens_per_rdma_rank does not describe is_token_in_rank")
        check(el * ranks // nodes <= INTERNODE_NOTIFY_THREADS, "experts per node exceed notify_dispatch's threads")
        if n:
            check(int(to_node.sum(1).max()) <= min(nodes, INTERNODE_MAX_TOPK_NODES),
                  f"a token goes to more than {min(nodes, INTERNODE_MAX_TOPK_NODES)} nodes (kNumTopkRDMARanks)")
        hidden_bytes = x.shape[1] * x.element_size()
        channels = self._check_internode_buffers(config, hidden_bytes, _bytes_per_token(hidden_bytes, k, k))
        self._mark_normal_used()
        rows = [None] * ranks  # the host waits for every rank's layout (notify_dispatch)
        dist.all_gather_object(rows, (is_token_in_rank.clone(), num_tokens_per_expert.view(ranks, el).clone()),
                               group=self.group)
        in_ranks = [r[0] for r in rows]
        recv_from = [int(t[:, me].sum()) for t in in_ranks]
        local = torch.stack([r[1][me] for r in rows]).long().sum(0)
        per_expert_list = [int(-(-c // expert_alignment) * expert_alignment) for c in local.tolist()]
        meta = pending(self._source_meta(in_ranks), "dispatch, async_finish")
        recv_x, _, recv_ids, recv_weights, event = self._post_tokens(
            x, topk_idx, topk_weights, is_token_in_rank, recv_from, el, k, async_finish, also=(meta,))
        chan = _channels(n, channels)
        recv_gbl_prefix, recv_gbl_chan = self._recv_global(in_ranks, channels)
        recv_rdma_prefix, recv_rdma_chan, send_nvl_head = self._recv_rdma(in_ranks, channels)
        handle = (is_token_in_rank, _channel_prefix(to_node, chan, channels),
                  _channel_prefix(is_token_in_rank, chan, channels), recv_rdma_chan, recv_rdma_prefix, recv_gbl_chan,
                  recv_gbl_prefix, meta, _slots(to_node, chan, channels), send_nvl_head)
        return recv_x, recv_ids, recv_weights, per_expert_list, handle, event

    def _recv_global(self, in_ranks: list[torch.Tensor], channels: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(recv_gbl_rank_prefix_sum [ranks] int32 inclusive, recv_gbl_channel_prefix_matrix [ranks, C] int32: where
        each source's channel starts among the received rows)."""
        me = self.rank
        counts = [int(t[:, me].sum()) for t in in_ranks]
        prefix = torch.tensor(counts, dtype=torch.int64).cumsum(0)
        starts = torch.zeros(len(in_ranks), channels, dtype=torch.int64)
        for s, t in enumerate(in_ranks):
            per_channel = torch.bincount(_channels(t.shape[0], channels)[t[:, me]], minlength=channels)
            starts[s] = prefix[s] - counts[s] + per_channel.cumsum(0) - per_channel
        return prefix.to(torch.int32), starts.to(torch.int32)

    def _recv_rdma(self, in_ranks: list[torch.Tensor], channels: int):
        """What reaches this rank's RDMA buffer: from the rank with its GPU index on every node, the tokens for any
        rank of this node. (recv_rdma_rank_prefix_sum [nodes] int32, recv_rdma_channel_prefix_matrix [nodes, C]
        int32, send_nvl_head [R_rdma, 8] int32: each token's slot in its channel's NVLink queue to each local rank,
        -1 where it does not go)."""
        node, gpu = divmod(self.rank, NUM_MAX_NVL_PEERS)
        local = slice(node * NUM_MAX_NVL_PEERS, (node + 1) * NUM_MAX_NVL_PEERS)
        counts, chan_prefix, heads = [], [], []
        next_slot = torch.zeros(channels, NUM_MAX_NVL_PEERS, dtype=torch.int32)
        for r in range(self.num_rdma_ranks):
            t = in_ranks[r * NUM_MAX_NVL_PEERS + gpu]
            mine = in_node(t)[:, node]
            chan = _channels(t.shape[0], channels)[mine]
            counts.append(int(mine.sum()))
            chan_prefix.append(torch.bincount(chan, minlength=channels).cumsum(0))
            dests = t[mine][:, local]
            head = torch.full(dests.shape, -1, dtype=torch.int32)
            for i, c in enumerate(chan.tolist()):
                for j in dests[i].nonzero(as_tuple=True)[0].tolist():
                    head[i, j] = next_slot[c, j]
                    next_slot[c, j] += 1
            heads.append(head)
        return (torch.tensor(counts).cumsum(0).to(torch.int32), torch.stack(chan_prefix).to(torch.int32),
                torch.cat(heads).contiguous())

    def _source_meta(self, in_ranks: list[torch.Tensor]) -> torch.Tensor:
        """recv_src_meta [R, 8] uint8: per received row, DeepEP's ``SourceMeta`` (int32 source node, int32 bits of
        this node's ranks the token goes to)."""
        node = self.rank // NUM_MAX_NVL_PEERS
        bit = 1 << torch.arange(NUM_MAX_NVL_PEERS)
        metas = []
        for s, t in enumerate(in_ranks):
            got = t[t[:, self.rank]]
            bits = (got[:, node * NUM_MAX_NVL_PEERS:(node + 1) * NUM_MAX_NVL_PEERS].long() * bit).sum(1)
            metas.append(torch.stack([torch.full_like(bits, s // NUM_MAX_NVL_PEERS), bits], dim=1))
        return torch.cat(metas).to(torch.int32).contiguous().view(torch.uint8)

    def _internode_combine(self, x, handle, topk_weights, bias, config, previous_event, async_finish: bool,
                           allocate_on_comm_stream: bool):
        """``combine`` above 8 ranks: the rows each source sent come back and are summed per token (no weights)."""
        if bias is not None:
            raise NotImplementedError("the double does not model the combine bias")
        self._stream_args(previous_event, async_finish, allocate_on_comm_stream)
        (in_rank, _, _, rdma_chan, rdma_prefix, gbl_chan, gbl_prefix, src_meta, rdma_head, nvl_head) = handle
        ranks, nodes = self.group_size, self.num_rdma_ranks
        channels = config.num_sms // 2
        r, h, es = x.shape[0], x.shape[1], x.element_size()
        check(x.dim() == 2 and x.is_contiguous() and h * es % 16 == 0, "x: contiguous [R, H]")
        check(x.dtype in self.limits.dtypes, f"Unsupported type {x.dtype} (the combine kernels take bfloat16)")
        check(src_meta.dim() == 2 and src_meta.is_contiguous() and src_meta.dtype == torch.uint8
              and src_meta.size(1) == SOURCE_META_BYTES, "src_meta: contiguous uint8 [R, 8]")
        check(in_rank.dim() == 2 and in_rank.is_contiguous() and in_rank.dtype == torch.bool
              and in_rank.size(1) == ranks, "is_combined_token_in_rank: contiguous bool [N, ranks]")
        n = in_rank.shape[0]
        for t, shape, what in ((rdma_chan, (nodes, channels), "rdma_channel_prefix_matrix"),
                               (rdma_prefix, (nodes,), "rdma_rank_prefix_sum"),
                               (gbl_chan, (ranks, channels), "gbl_channel_prefix_matrix"),
                               (rdma_head, (n, nodes), "combined_rdma_head")):
            check(t.dtype == torch.int32 and t.is_contiguous() and tuple(t.shape) == shape,
                  f"{what}: contiguous int32 {shape} (dispatch and combine configs must have the same num_sms)")
        check(nvl_head.dtype == torch.int32 and nvl_head.dim() == 2 and nvl_head.is_contiguous()
              and nvl_head.size(1) == NUM_MAX_NVL_PEERS, "combined_nvl_head: contiguous int32 [R_rdma, 8]")
        check(src_meta.size(0) == r and int(gbl_prefix[-1]) == r,
              "x must have one row per received token of the handle")
        k = self._check_combine_weights(topk_weights, r, INTERNODE_MAX_TOPK, "internode")
        nvl_recv, nvl_send = config.num_max_nvl_chunked_recv_tokens, config.num_max_nvl_chunked_send_tokens
        rdma_send = config.num_max_rdma_chunked_send_tokens
        per_forwarder = max(INTERNODE_COMBINE_FORWARDER_WARPS // nodes, 1)
        check(nvl_recv % nodes == 0 and nvl_send <= nvl_recv // nodes, "config: NVLink chunks per RDMA rank")
        check(nodes <= INTERNODE_COMBINE_FORWARDER_WARPS and nodes * per_forwarder > NUM_MAX_NVL_PEERS
              and nvl_recv // nodes > max(rdma_send, nvl_send) and nvl_recv // nodes - per_forwarder >= nvl_send
              and rdma_send >= per_forwarder, "config: the combine's forwarder warps")
        self._check_internode_buffers(config, h * es, _bytes_per_token(h * es, 0, k))
        self._mark_normal_used()
        src_meta.sum()  # the rows' sources must have arrived (raises on an unreceived dispatch)
        prefix = gbl_prefix.long()
        send_counts = (prefix - torch.cat([prefix.new_zeros(1), prefix[:-1]])).tolist()
        back_tokens = [in_rank[:, d].nonzero(as_tuple=True)[0] for d in range(ranks)]
        return self._post_rows(x, topk_weights, send_counts, back_tokens, n, async_finish)
