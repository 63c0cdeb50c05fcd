"""Low-latency kernels of the DeepEP double (``deep_ep_double``): ``low_latency_dispatch`` / ``low_latency_combine``
/ ``clean_low_latency_buffer`` and the RDMA size hint, over one equal-split gloo ``all_to_all_single`` per kernel.

Layouts follow DeepEP v1.2.1: ``recv_x`` [E_local, M_max * ranks, H] with each expert's rows packed at the front
(source-rank blocks in an order that changes between calls, as DeepEP's arrival order does; the rest NaN),
``recv_count`` [E_local] int32, handle ``(src_info [E_local, M_max * ranks] int32 source token of each row,
layout_range [E_local, ranks] int64 = (count << 32) | begin, M_max, H, E)``. The combine writes each expert
output row into the source rank's slot (expert, token) and reduces ``sum_j w[t, j] * row(topk_idx[t, j], t)``
in float32, as DeepEP's combine applies the weights.

Like DeepEP, every kernel flips between two buffers; a kernel whose buffer still holds an unreceived kernel
raises, and so does a low-latency kernel after a normal-mode one without ``clean_low_latency_buffer``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deep_ep_double_core import (
    ALIGN,
    LL_MAX_TOPK,
    NUM_DEVICE_SMS,
    WORKSPACE_BYTES,
    EventHandle,
    EventOverlap,
    check,
    check_expert_ids,
    deliver,
    misuse,
    pending,
)
from deep_ep_double_graph import library_call, receive_call

LL_HIDDEN_SIZES = (2048, 2560, 4096, 5120, 6144, 7168, 8192)  # SWITCH_HIDDEN of the low-latency kernels


def ll_layout_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of DeepEP's two low-latency buffers (``LowLatencyLayout`` in ``csrc/config.hpp``, BF16 messages)."""
    m, scales = num_max_dispatch_tokens_per_rank, hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2
    send = max(m * dispatch_msg, num_experts * m * combine_msg)
    recv = max(num_experts * m * dispatch_msg, num_experts * m * combine_msg)
    signal = -(-num_experts * 4 // 128) * 128
    return 2 * (send + recv + signal)


def _bytes(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.contiguous().reshape(rows, -1).view(torch.uint8)


def _split(buf: torch.Tensor, widths: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Columns of uint8 rows [ranks, B] as tensors [ranks, *shape] of the given dtypes."""
    out, col = [], 0
    for dtype, shape in widths:
        nb = dtype.itemsize * int(torch.tensor(shape).prod()) if shape else dtype.itemsize
        out.append(buf.new_empty((buf.shape[0], nb)).copy_(buf[:, col:col + nb]).view(dtype).view(buf.shape[0], *shape))
        col += nb
    return out


def _quant_fp8(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and group of 128 channels, as the FP8 dispatch kernel: ``x`` [N, H] bf16 -> (float8_e4m3fn
    [N, H], float32 [N, H / 128]) with ``scale = max(amax, 1e-4) / 448`` (rounded up to a power of two with
    ``round_scale``)."""
    n, h = x.shape
    g = x.float().view(n, h // 128, 128)
    scale = g.abs().amax(dim=-1).clamp(min=1e-4) / 448.0
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (g / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(n, h), scale


class LowLatencyMixin:
    """The low-latency half of the double's ``Buffer`` (needs ``group``, ``rank``, ``group_size``, ``limits``,
    ``low_latency_mode``, ``num_rdma_bytes``, ``num_qps_per_rank``)."""

    def _init_low_latency(self) -> None:
        self._ll_next, self._ll_busy, self._ll_dirty, self._ll_calls = 0, [None, None], False, 0

    def _mark_normal_used(self) -> None:
        self._ll_dirty = self.low_latency_mode

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        n = ll_layout_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
        return (n + ALIGN) // ALIGN * ALIGN

    @library_call("clean_low_latency_buffer")
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Zero the low-latency signals (collective: every rank must call it)."""
        check(self.runtime is not None, "buffer destroyed")
        check(self.low_latency_mode, "clean_low_latency_buffer needs low_latency_mode")
        check(ll_layout_bytes(num_max_dispatch_tokens_per_rank, hidden, self.group_size, num_experts)
              <= self.num_rdma_bytes, "num_rdma_bytes too small")
        if any(b is not None for b in self._ll_busy):
            raise misuse("clean_low_latency_buffer while low-latency results are in flight would wipe them")
        dist.barrier(group=self.group)
        self._ll_dirty = False

    def _ll_checks(self, m: int, hidden: int, num_experts: int, dtype: torch.dtype, num_topk: int) -> None:
        check(self.runtime is not None, "buffer destroyed")
        check(self.low_latency_mode, "low-latency kernels need low_latency_mode=True")
        check(num_topk <= LL_MAX_TOPK, f"num_topk {num_topk} > kNumMaxTopK {LL_MAX_TOPK} of the low-latency kernels")
        groups = -(-num_experts // NUM_DEVICE_SMS)
        warps = 32 // groups
        check(groups > 0 and warps > 0 and LL_MAX_TOPK + 1 <= groups * warps, "too many experts for the launch")
        check(num_experts * 4 * 2 <= WORKSPACE_BYTES, "num_experts exceeds the workspace")
        if self._ll_dirty:
            raise misuse("a low-latency kernel after a normal-mode one without clean_low_latency_buffer")
        sizes = self.limits.ll_hidden_sizes
        check(dtype in self.limits.dtypes, f"low-latency kernels take bfloat16, got {dtype}")
        check(hidden % 16 == 0 and (sizes is None or (hidden % 128 == 0 and hidden in sizes)),
              f"Unsupported hidden {hidden}")
        check(num_experts % self.group_size == 0 and (self.group_size * m) % 4 == 0, "experts / M_max * ranks % 4")
        check(self.num_qps_per_rank >= num_experts // self.group_size, "num_qps_per_rank < local experts")
        check(ll_layout_bytes(m, hidden, self.group_size, num_experts) <= self.num_rdma_bytes,
              "num_rdma_bytes too small (get_low_latency_rdma_size_hint)")

    def _ll_claim(self, async_finish: bool, return_recv_hook: bool) -> tuple[int, object]:
        """Take the buffer of the next kernel (before anything is sent); returns (slot, token)."""
        check(not (async_finish and return_recv_hook), "async_finish and return_recv_hook are exclusive")
        slot = self._ll_next
        if self._ll_busy[slot] is not None:
            raise misuse("a third low-latency result in flight: this kernel's buffer still holds one that was "
                         "not received (DeepEP keeps two low-latency buffers)")
        token = object()
        self._ll_busy[slot], self._ll_next = token, slot ^ 1
        return slot, token

    def _ll_finish(self, claim, async_finish: bool, return_recv_hook: bool, work, receive, aliases):
        """(EventOverlap, hook) of a posted kernel whose data ``receive()`` unpacks into ``aliases``' storage."""
        slot, token = claim
        done = []

        def finish():
            if done:
                raise misuse("low-latency hook called twice")
            done.append(True)
            work.wait()
            receive()
            deliver(*aliases)
            self._ll_busy[slot] = None

        finish = receive_call(finish)
        if return_recv_hook:
            return EventOverlap(None), finish
        if async_finish:
            return EventOverlap(EventHandle(on_wait=finish)), None
        finish()
        return EventOverlap(None), None

    @library_call("low_latency_dispatch", low_latency=True)
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """(recv_x [E_local, M_max * ranks, H], recv_count [E_local] int32, handle, EventOverlap, hook); with
        ``use_fp8`` recv_x is (float8_e4m3fn [E_local, T, H], float32 scales [E_local, T, H / 128] in DeepEP's
        column-major layout, T = M_max * ranks): each token quantized per group of 128 channels with ``scale =
        max(amax, 1e-4) / 448`` (a power of two with ``round_scale``), as ``internode_ll.cu`` does."""
        if dispatch_wait_recv_cost_stats is not None:
            raise NotImplementedError("the double models dispatches without wait-cost stats")
        check(not use_ue8m0 or round_scale, "use_ue8m0 needs round_scale")
        check(not use_ue8m0, "the double models float32 scales (use_ue8m0=False, SM90)")
        ranks, m = self.group_size, num_max_dispatch_tokens_per_rank
        n, h = x.shape
        el = num_experts // ranks
        check(not use_fp8 or h % 512 == 0, f"FP8 low-latency dispatch needs hidden % 512 == 0, got {h}")
        check(topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == torch.int64, "topk_idx int64")
        self._ll_checks(m, h, num_experts, x.dtype, topk_idx.shape[1])
        check(x.dim() == 2 and x.is_contiguous(), "x: contiguous [N, H]")
        check_expert_ids(topk_idx, num_experts)
        check(topk_idx.shape[0] == n and n <= m, f"{n} tokens exceed num_max_dispatch_tokens_per_rank {m}")
        stats = cumulative_local_expert_recv_stats
        check(stats is None or (stats.dtype == torch.int32 and tuple(stats.shape) == (el,)), "recv stats")
        valid = topk_idx >= 0
        rows, g = valid.nonzero(as_tuple=True)[0], topk_idx[valid]
        onehot = torch.zeros(n, num_experts, dtype=torch.int64).index_put_((rows, g), torch.ones_like(g),
                                                                          accumulate=True)
        check(bool((onehot <= 1).all()), "a token selects the same expert twice")
        slot = (onehot.cumsum(0) - onehot)[rows, g]
        row_dtype = torch.float8_e4m3fn if use_fp8 else x.dtype
        send_x = torch.zeros(num_experts, m, h, dtype=row_dtype)
        send_src = torch.full((num_experts, m), -1, dtype=torch.int32)
        sends = [send_x]
        if use_fp8:
            q, s = _quant_fp8(x, round_scale)
            send_s = torch.zeros(num_experts, m, h // 128, dtype=torch.float32)
            send_x[g, slot], send_s[g, slot] = q[rows], s[rows]
            sends.append(send_s)
        else:
            send_x[g, slot] = x[rows]
        send_src[g, slot] = rows.to(torch.int32)
        header = torch.tensor([m, h, num_experts, x.dtype.itemsize, int(use_fp8)], dtype=torch.int64)
        payload = torch.cat([*(_bytes(t, ranks) for t in sends), _bytes(send_src, ranks),
                             _bytes(onehot.sum(0), ranks), _bytes(header.repeat(ranks), ranks)], dim=1)
        claim = self._ll_claim(async_finish, return_recv_hook)
        recv = torch.empty_like(payload)
        work = dist.all_to_all_single(recv, payload, group=self.group, async_op=True)
        t = ranks * m
        out = [torch.empty(el, t, h, dtype=row_dtype), torch.empty(el, dtype=torch.int32),
               torch.empty(el, t, dtype=torch.int32), torch.empty(el, ranks, dtype=torch.int64)]
        if use_fp8:  # DeepEP's scales are column-major per expert (what DeepGEMM's masked GEMM reads)
            out.append(torch.empty_strided((el, t, h // 128), (t * (h // 128), 1, t), dtype=torch.float32))
        why = "low_latency_dispatch, " + ("hook" if return_recv_hook else "async_finish")
        aliases = [pending(t, why) for t in out] if (return_recv_hook or async_finish) else out
        shift, self._ll_calls = self._ll_calls % ranks, self._ll_calls + 1

        def receive():
            scales = [(torch.float32, (el, m, h // 128))] if use_fp8 else []
            parts = _split(recv, [(row_dtype, (el, m, h)), *scales, (torch.int32, (el, m)), (torch.int64, (el,)),
                                  (torch.int64, (5,))])
            rx, rs = parts[0], (parts[1] if use_fp8 else None)
            rsrc, rcnt, rhdr = parts[-3:]
            if not torch.equal(rhdr, header.expand(ranks, 5)):
                raise misuse(f"ranks disagree on (M_max, hidden, experts, itemsize, use_fp8): {rhdr.tolist()}")
            packed_x, count, src_info, layout_range = out[:4]
            packed_x.fill_(float("nan") if x.dtype.is_floating_point else 0)
            if use_fp8:
                out[4].fill_(float("nan"))
            src_info.fill_(-1)
            for e in range(el):
                begin = 0
                for j in range(ranks):
                    s = (j + shift) % ranks
                    c = int(rcnt[s, e])
                    packed_x[e, begin:begin + c] = rx[s, e, :c]
                    if use_fp8:
                        out[4][e, begin:begin + c] = rs[s, e, :c]
                    src_info[e, begin:begin + c] = rsrc[s, e, :c]
                    layout_range[e, s] = (c << 32) | begin
                    begin += c
                count[e] = begin
            if stats is not None:
                stats.add_(count)

        event, hook = self._ll_finish(claim, async_finish, return_recv_hook, work, receive, aliases)
        aliases[2]._double_dispatch = (topk_idx.clone(), m, h, num_experts)
        handle = (aliases[2], aliases[3], m, h, num_experts)
        recv_x = (aliases[0], aliases[4]) if use_fp8 else aliases[0]
        return recv_x, aliases[1], handle, event, hook

    @library_call("low_latency_combine", low_latency=True)
    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None):
        """(combined_x [N, H] in ``x``'s dtype, EventOverlap, hook): ``sum_j topk_weights[t, j] * row``."""
        if use_logfmt or zero_copy or combine_wait_recv_cost_stats is not None:
            raise NotImplementedError("the double models plain BF16 combines without stats")
        src_info, layout_range, m, hidden, num_experts = handle
        ranks, el = self.group_size, num_experts // self.group_size
        self._ll_checks(m, x.shape[-1], num_experts, x.dtype, topk_idx.shape[1] if topk_idx.dim() == 2 else 0)
        check(x.dim() == 3 and x.is_contiguous() and tuple(x.shape) == (el, ranks * m, hidden),
              f"x must be [E_local, M_max * ranks, H] = {(el, ranks * m, hidden)}, got {tuple(x.shape)}")
        check(topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == torch.int64, "topk_idx")
        check(topk_weights.is_contiguous() and topk_weights.shape == topk_idx.shape
              and topk_weights.dtype == torch.float32 and topk_weights.shape[0] <= m, "topk_weights float32 [N, k]")
        check(src_info.dtype == torch.int32 and tuple(src_info.shape) == (el, ranks * m)
              and layout_range.dtype == torch.int64 and tuple(layout_range.shape) == (el, ranks), "handle")
        n = topk_idx.shape[0]
        check(out is None or (tuple(out.shape) == (n, hidden) and out.dtype == x.dtype), "out")
        sent_ids = getattr(src_info, "_double_dispatch", (None,))[0]
        check(sent_ids is not None and torch.equal(sent_ids, topk_idx), "topk_idx is not the one of this dispatch")
        send_x = torch.zeros(ranks, el, m, hidden, dtype=x.dtype)
        written = torch.zeros(ranks, el, m, dtype=torch.uint8)
        for e in range(el):
            for s in range(ranks):
                packed = int(layout_range[e, s])  # raises if the dispatch was not received
                c, begin = packed >> 32, packed & 0xFFFFFFFF
                tok = src_info[e, begin:begin + c].long()
                send_x[s, e, tok], written[s, e, tok] = x[e, begin:begin + c], 1
        payload = torch.cat([_bytes(send_x, ranks), _bytes(written, ranks)], dim=1)
        claim = self._ll_claim(async_finish, return_recv_hook)
        recv = torch.empty_like(payload)
        work = dist.all_to_all_single(recv, payload, group=self.group, async_op=True)
        result = torch.empty(n, hidden, dtype=x.dtype) if out is None else out
        aliases = [pending(result, "low_latency_combine, hook")] if (return_recv_hook or async_finish) else [result]

        def receive():
            rx, rmask = _split(recv, [(x.dtype, (el, m, hidden)), (torch.uint8, (el, m))])
            rx, rmask = rx.view(num_experts, m, hidden), rmask.view(num_experts, m)
            t, j = (topk_idx >= 0).nonzero(as_tuple=True)
            g = topk_idx[t, j]
            if not bool(rmask[g, t].all()):
                raise misuse("an expert output row of a dispatched token never came back")
            acc = torch.zeros(n, hidden, dtype=torch.float32)
            acc.index_add_(0, t, rx[g, t].float() * topk_weights[t, j].unsqueeze(1))
            result.copy_(acc)

        event, hook = self._ll_finish(claim, async_finish, return_recv_hook, work, receive, aliases)
        return aliases[0], event, hook

    def get_next_low_latency_combine_buffer(self, handle):
        raise NotImplementedError("the double does not model zero-copy combines")
