"""Paged attention through vLLM's flash-attention kernel: ``flash_attn_varlen_func`` over a block table (GPU).

The kernel comes from ``raymoe.platform.cuda.flash_attn_provider`` (``vllm.vllm_flash_attn``, imported only when this
backend is built; tests inject a CPU conformance double). One kernel call per layer serves every step kind:
decode, extend, extend over a radix-cache prefix, chunked prefill, MIXED.

Cache layout: the rank's ``TokenToKVPool`` keeps each layer's keys and values as [num_slots + 1, Hkv, D]; this
backend views them as [num_pages, page_size, Hkv, D], the kernel's paged layout (so the pool must be a whole number
of pages, and the kernel wants ``page_size`` a multiple of 16). It first stores the step's new keys/values at
``forward_batch.out_cache_loc``, then attends.

Paging: the driver's allocator hands out slots in pages (``raymoe.kvcache.paged_allocator``): every aligned run of
``page_size`` positions of a request lies in order in one page, and a radix-cache hit is cut to whole pages. So
the block table of a request is its ReqToTokenPool row sampled at every page start, divided by the page size:
``block_table[r, j] = req_to_token[row_r, j * page_size] // page_size``. Page 0 holds the dummy slot 0.

Per-step metadata (:class:`FlashAttnMetadata`), int32 as the kernel requires: ``cu_seqlens_q`` [bs + 1] (prefix
sums of the query tokens per request: extend lengths, or 1 per decode row), ``seqused_k`` [bs] (``seq_lens``:
cached prefix plus this step's tokens), ``block_table`` [bs, pages]. With ``causal=True`` the kernel aligns the mask
to the bottom right, so query ``t`` of a request with ``q_len`` new tokens and ``seq_len`` keys sees keys
``[0, seq_len - q_len + t]``: its cached prefix and the new tokens up to itself.

Decode graphs (``raymoe.runner.graph_runner``): fixed-address buffers of ``max_bs`` rows (``graph_block_table``
[max_bs, W / page_size], ``graph_seqused_k`` [max_bs], ``graph_cu_seqlens_q`` = arange(max_bs + 1)) are refreshed
in place before each replay; ``max_seqlen_k`` is then the graph width W (tokens), since a captured graph cannot
follow the step's longest sequence. Padding rows attend to one slot (fill value 1).

Sliding windows and attention sinks (gpt-oss; ``windows`` / ``sinks`` per layer): a window of ``w`` tokens is the
kernel's ``window_size=(w - 1, 0)`` (query ``t`` sees keys ``[seq_len - q_len + t - (w - 1), seq_len - q_len + t]``);
sinks are its ``s_aux`` [Hq], which only the FA3 kernels take (the fork's FA2 path raises; its FA3 entry wants
bfloat16, contiguous, at most 64 query heads, Hopper), so sinks are cast to bfloat16 once when the backend is built
(after the weights are loaded) and a backend with sinks on FA2 is refused.

Not supported: MLA models (DeepSeek; their ``create_attn_backend`` refuses this backend: they take
``flashinfer_mla``, ``raymoe.platform.cuda.flashinfer_mla``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from raymoe.attention.base import AttentionBackend
from raymoe.kvcache.pools import ReqToTokenPool, TokenToKVPool
from raymoe.platform.cuda.flash_attn_provider import MIN_PAGE_MULTIPLE, FlashAttnProvider
from raymoe.step.host_transfer import to_device


@dataclass(frozen=True)
class FlashAttnMetadata:
    """What every layer of one step passes to the kernel (shapes above; lengths in tokens)."""

    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


class FlashAttnBackend(AttentionBackend):
    """Block-table paged attention through ``flash_attn_varlen_func``.

    Args:
        req_to_token_pool: the rank's request -> slot table (its ``page_size`` is the page size).
        token_to_kv_pool: the rank's KV tensors ([num_slots + 1, Hkv, D] per layer).
        num_heads, num_kv_heads: this rank's query / kv heads; head_dim: D. Scale is ``D ** -0.5``.
        provider: the kernel; ``None`` looks it up (``flash_attn_provider.find_flash_attn``).
        windows: per layer, a sliding window in tokens or None (None: no layer has one).
        sinks: per layer, [num_heads] sink logits or None (None: no layer has them).

    Raises:
        BackendUnavailableError: ``provider`` is None and ``vllm`` is not installed.
        ValueError: the page size is not a multiple of 16, the pool is not a whole number of pages,
            ``num_heads`` is not a multiple of ``num_kv_heads``, or sinks are given to an FA2 kernel.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool, num_heads: int,
                 num_kv_heads: int, head_dim: int, provider: FlashAttnProvider | None = None,
                 windows: Sequence[int | None] | None = None, sinks: Sequence[torch.Tensor | None] | None = None):
        if provider is None:
            from raymoe.platform.cuda import flash_attn_provider

            provider = flash_attn_provider.find_flash_attn()
        page = req_to_token_pool.page_size
        if page % MIN_PAGE_MULTIPLE:
            raise ValueError(f"the flash_attn backend needs page_size a multiple of {MIN_PAGE_MULTIPLE}, got {page}")
        rows = token_to_kv_pool.k_buffer[0].shape[0]
        if rows % page:
            raise ValueError(f"KV pool of {rows} slots is not a whole number of {page}-token pages")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.varlen_func = provider.varlen_func
        self.fa_version = provider.fa_version
        self.req_to_token = req_to_token_pool.req_to_token
        self.page_size = page
        self.kv_pool = token_to_kv_pool
        self.scale = head_dim ** -0.5
        self.meta: FlashAttnMetadata | None = None
        if sinks is not None and any(s is not None for s in sinks) and self.fa_version != 3:
            raise ValueError(f"attention sinks need the FA3 kernels (s_aux); {provider.name} runs FA{self.fa_version}")
        self.layer_kwargs = [{} for _ in range(len(windows if windows is not None else sinks or ()))]
        for layer, kw in enumerate(self.layer_kwargs):
            if windows is not None and windows[layer] is not None:
                kw["window_size"] = (windows[layer] - 1, 0)
            if sinks is not None and sinks[layer] is not None:
                kw["s_aux"] = sinks[layer].to(torch.bfloat16).contiguous()

    def _block_table(self, req_pool_indices: torch.Tensor, num_pages: int) -> torch.Tensor:
        """Pages of the first ``num_pages`` page-runs of each row: [bs] int64 rows -> [bs, num_pages] int32."""
        starts = self.req_to_token[req_pool_indices, :: self.page_size][:, :num_pages]
        return (starts // self.page_size).to(torch.int32)

    def init_forward_metadata(self, forward_batch) -> None:
        fb = forward_batch
        if fb.forward_mode.is_idle() or fb.batch_size == 0:
            return
        q_lens = [1] * fb.batch_size if fb.forward_mode.is_decode() else fb.extend_lens_cpu
        max_k = max(fb.seq_lens_cpu)
        dev = fb.seq_lens.device
        self.meta = FlashAttnMetadata(
            cu_seqlens_q=to_device([0, *accumulate(q_lens)], torch.int32, dev),
            seqused_k=fb.seq_lens.to(torch.int32),
            block_table=self._block_table(fb.req_pool_indices, -(-max_k // self.page_size)),
            max_seqlen_q=max(q_lens), max_seqlen_k=max_k)

    def forward_extend(self, q, k, v, layer_id, forward_batch):
        return self._attend(q, k, v, layer_id, forward_batch)

    def forward_decode(self, q, k, v, layer_id, forward_batch):
        return self._attend(q, k, v, layer_id, forward_batch)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, forward_batch) -> torch.Tensor:
        """Store ``k``/``v`` [T, Hkv, D] at ``out_cache_loc``, then attend: ``q`` [T, Hq, D] -> [T, Hq, D]."""
        self.kv_pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer_id)
        paged = (-1, self.page_size, *k_buf.shape[1:])
        m = self.meta
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.varlen_func(q=q, k=k_buf.view(paged), v=v_buf.view(paged), max_seqlen_q=m.max_seqlen_q,
                         cu_seqlens_q=m.cu_seqlens_q, max_seqlen_k=m.max_seqlen_k, seqused_k=m.seqused_k,
                         softmax_scale=self.scale, causal=True, block_table=m.block_table,
                         fa_version=self.fa_version, out=out,
                         **(self.layer_kwargs[layer_id] if self.layer_kwargs else {}))
        return out

    # ---- decode graph hooks ----
    def init_cuda_graph_state(self, max_bs: int, max_kv_len: int) -> None:
        """Buffers for graphs of up to ``max_bs`` rows over W = ``min(max_kv_len, max_context_len)`` tokens."""
        width = min(max_kv_len, self.req_to_token.shape[1])
        dev = self.req_to_token.device
        self.graph_block_table = torch.zeros((max_bs, -(-width // self.page_size)), dtype=torch.int32, device=dev)
        self.graph_seqused_k = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.graph_cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.graph_max_seqlen_k = width

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens, forward_mode, *,
                                                 kv_width=None) -> None:
        self.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, [], forward_mode)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_cpu,
                                                forward_mode, *, kv_width=None) -> None:
        """Refresh rows ``[0, bs)`` of the buffers in place and point this step's metadata at them. ``kv_width``
        is ignored: the kernel reads each row only up to its ``seqused_k``, so one full-width graph is as fast
        (``supports_graph_kv_widths`` is False and the runner captures one width)."""
        pages = self.graph_block_table.shape[1]
        self.graph_block_table[:bs].copy_(self._block_table(req_pool_indices[:bs], pages))
        self.graph_seqused_k[:bs].copy_(seq_lens[:bs])
        self.meta = FlashAttnMetadata(self.graph_cu_seqlens_q[: bs + 1], self.graph_seqused_k[:bs],
                                      self.graph_block_table[:bs], 1, self.graph_max_seqlen_k)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """1: a padding row attends to one slot of its (row 0) table."""
        return 1
