"""Paged multi-head latent attention through FlashInfer's ``BatchMLAPagedAttentionWrapper`` (GPU).

The wrapper comes from ``raymoe.platform.cuda.flashinfer_mla_provider`` (``flashinfer.mla``, imported only when this
backend is built; tests inject a CPU conformance double). One kernel serves every step kind, always in the
weight-absorbed form (DeepSeek-V2 paper, arXiv:2405.04434, appendix; FlashInfer's MLA blog, 2025-02-10): a query is
``[q_nope W_UK | q_pe]`` per head and attends over the latent cache rows as one shared key head; the output stays in
latent space (``kv_lora_rank`` per head) and the layer applies ``W_UV``. The backend says so with
``mla_absorbed_extend = True``, so ``raymoe.layers.mla`` absorbs the queries of extend and MIXED steps too (as
SGLang's ``flashinfer_mla`` backend does with its ragged prefill disabled).

Cache layout: the rank's ``MLATokenToKVPool`` row of a token is ``[c_KV | k_pe]`` ([num_slots + 1, 576] per layer
for DeepSeek-V3); the kernel takes ``ckv_cache`` [num_pages, page_size, kv_lora_rank] and ``kpe_cache``
[num_pages, page_size, qk_rope_head_dim], strided views of the same buffer (the kernel reads the page and token
strides; the last dim is contiguous). The pool must be a whole number of pages. This step's rows are stored at
``forward_batch.out_cache_loc`` first.

Per-step metadata, int32 as the kernel requires, planned once per step (``plan`` runs on the host: it copies the
index arrays there and partitions the work): ``qo_indptr`` [bs + 1] (prefix sums of the query tokens: extend
lengths, or 1 per decode row), ``kv_indptr`` [bs + 1] (prefix sums of each request's pages,
``ceil(seq_len / page_size)``), ``kv_indices`` [kv_indptr[-1]] (the pages, request after request: the request's
ReqToTokenPool row sampled at every page start, divided by the page size, as ``raymoe.platform.cuda.flash_attn``
builds its block table), ``kv_len_arr`` [bs] (``seq_lens``, tokens). Extend steps plan ``causal=True``: the
kernel aligns the mask to the bottom right, so query ``t`` of a request with ``q_len`` new tokens over ``seq_len``
keys sees keys ``[0, seq_len - q_len + t]``; decode plans ``causal=False`` (one query sees every key).

Decode graphs (``raymoe.runner.graph_runner``): one wrapper per captured bucket ``bs`` built with
``use_cuda_graph=True`` over fixed-address buffers (``qo_indptr``/``kv_indptr`` [max_bs + 1], ``kv_len_arr``
[max_bs], sliced to the bucket, and ``kv_indices`` [max_bs * ceil(W / page_size)] for the graph width W), as
SGLang does; ``plan`` runs before the capture and again before each replay, outside the graph (it copies the new
indices into the same buffers and the same workspace offsets). The kernel reads each row only up to its
``kv_len``, so one full-width graph per bucket is as fast (``supports_graph_kv_widths`` is False). Padding rows
attend to one slot (fill value 1).
"""

from __future__ import annotations

import torch

from raymoe.attention.base import AttentionBackend
from raymoe.kvcache.mla_pool import MLATokenToKVPool
from raymoe.kvcache.pools import ReqToTokenPool
from raymoe.platform.cuda.flashinfer_mla_provider import FlashInferMLAProvider


class FlashInferMLABackend(AttentionBackend):
    """Paged MLA through ``BatchMLAPagedAttentionWrapper`` (module docstring).

    Args:
        req_to_token_pool: the rank's request -> slot table (its ``page_size`` is the page size).
        token_to_kv_pool: the rank's latent cache ([num_slots + 1, kv_lora_rank + qk_rope] per layer).
        num_heads: this rank's query heads. softmax_scale: ``MLAConfig.softmax_scale`` (YaRN mscale included).
        provider: the wrapper; ``None`` looks it up (``flashinfer_mla_provider.find_flashinfer_mla``).
    Raises:
        BackendUnavailableError: ``provider`` is None and FlashInfer is not installed.
        ValueError: the cache's ``(kv_lora_rank, qk_rope_head_dim)`` or dtype is not one the provider takes, or the
            pool is not a whole number of pages.
    """

    mla_absorbed_extend = True
    supports_graph_kv_widths = False

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: MLATokenToKVPool, num_heads: int,
                 softmax_scale: float, provider: FlashInferMLAProvider | None = None):
        if provider is None:
            from raymoe.platform.cuda import flashinfer_mla_provider

            provider = flashinfer_mla_provider.find_flashinfer_mla()
        dims = (token_to_kv_pool.kv_lora_rank, token_to_kv_pool.qk_rope_head_dim)
        if dims not in provider.head_dims:
            raise ValueError(f"the flashinfer_mla backend ({provider.name}) takes (kv_lora_rank, qk_rope_head_dim) "
                             f"in {provider.head_dims}, the model has {dims}; use attention_backend='torch_native'")
        dtype_name = str(token_to_kv_pool.dtype).removeprefix("torch.")
        if dtype_name not in provider.dtypes:
            raise ValueError(f"the flashinfer_mla backend ({provider.name}) takes {provider.dtypes}, the cache is "
                             f"{dtype_name}")
        page = req_to_token_pool.page_size
        rows = token_to_kv_pool.kv_buffer[0].shape[0]
        if rows % page:
            raise ValueError(f"latent cache of {rows} slots is not a whole number of {page}-token pages")
        self.provider = provider
        self.req_to_token = req_to_token_pool.req_to_token
        self.page_size = page
        self.kv_pool = token_to_kv_pool
        self.num_heads = num_heads
        self.kv_lora_rank, self.qk_rope_head_dim = dims
        self.scale = softmax_scale
        self.dtype = token_to_kv_pool.dtype
        device = self.req_to_token.device
        self.workspace = torch.empty(provider.workspace_bytes, dtype=torch.uint8, device=device)
        self.wrapper = provider.wrapper_cls(self.workspace, backend="auto")
        self.active = None  # the wrapper planned for this step
        self.graph_wrappers: dict[int, object] = {}

    # ---- metadata ----
    def _pages(self, req_pool_indices: torch.Tensor, seq_lens_cpu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_indptr`` [bs + 1] int32 (host) and ``kv_indices`` [pages] int32 (table's device) of the rows."""
        counts = torch.tensor([-(-n // self.page_size) for n in seq_lens_cpu], dtype=torch.int32)
        indptr = torch.zeros(len(seq_lens_cpu) + 1, dtype=torch.int32)
        torch.cumsum(counts, 0, out=indptr[1:])
        most = int(counts.max()) if len(seq_lens_cpu) else 0
        starts = self.req_to_token[req_pool_indices, :: self.page_size][:, :most]       # [bs, most] slots
        used = torch.arange(most, device=starts.device)[None, :] < counts.to(starts.device)[:, None]
        return indptr, (starts[used] // self.page_size).to(torch.int32)

    def _plan(self, wrapper, q_lens: list[int], req_pool_indices: torch.Tensor, seq_lens_cpu: list[int],
              causal: bool) -> None:
        qo_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0, out=qo_indptr[1:])
        kv_indptr, kv_indices = self._pages(req_pool_indices, seq_lens_cpu)
        kv_len = torch.tensor(seq_lens_cpu, dtype=torch.int32)
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, self.num_heads, self.kv_lora_rank,
                     self.qk_rope_head_dim, self.page_size, causal, self.scale, self.dtype, self.dtype)
        self.active = wrapper

    def init_forward_metadata(self, forward_batch) -> None:
        """Plan the eager wrapper for this step (nothing for an IDLE or empty batch)."""
        fb = forward_batch
        if fb.forward_mode.is_idle() or fb.batch_size == 0:
            return
        decode = fb.forward_mode.is_decode()
        q_lens = [1] * fb.batch_size if decode else list(fb.extend_lens_cpu)
        self._plan(self.wrapper, q_lens, fb.req_pool_indices, list(fb.seq_lens_cpu), causal=not decode)

    # ---- attention ----
    def forward(self, q, k, v, layer_id, forward_batch) -> torch.Tensor:
        """Dispatch on the mode; an IDLE batch returns an empty [0, H, 0] tensor (the layer reshapes it)."""
        if forward_batch.forward_mode.is_idle() or q.shape[0] == 0:
            return q.new_empty((0, q.shape[1], 0))
        return self._attend(q, k, layer_id, forward_batch)

    def forward_extend(self, q, k, v, layer_id, forward_batch):
        return self._attend(q, k, layer_id, forward_batch)

    def forward_decode(self, q, k, v, layer_id, forward_batch):
        return self._attend(q, k, layer_id, forward_batch)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, layer_id: int, forward_batch) -> torch.Tensor:
        """Store the rows ``k`` [T, kv_lora_rank + qk_rope] at ``out_cache_loc``, then attend with the absorbed
        queries ``q`` [T, H, kv_lora_rank + qk_rope] -> [T, H, kv_lora_rank]."""
        lora = self.kv_lora_rank
        self.kv_pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k[:, :lora], k[:, lora:])
        buf = self.kv_pool.get_kv_buffer(layer_id)
        ckv = buf[:, :lora].view(-1, self.page_size, lora)
        kpe = buf[:, lora:].view(-1, self.page_size, self.qk_rope_head_dim)
        return self.active.run(q[..., :lora], q[..., lora:], ckv, kpe)

    # ---- decode graph hooks ----
    def init_cuda_graph_state(self, max_bs: int, max_kv_len: int) -> None:
        """Fixed buffers for graphs of up to ``max_bs`` rows over W = ``min(max_kv_len, max_context_len)`` tokens."""
        width = min(max_kv_len, self.req_to_token.shape[1])
        dev = self.req_to_token.device
        self.graph_max_bs = max_bs
        self.graph_qo_indptr = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self.graph_kv_len = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.graph_kv_indices = torch.zeros(max_bs * -(-width // self.page_size), dtype=torch.int32, device=dev)

    def _graph_wrapper(self, bs: int):
        if bs > self.graph_max_bs:
            raise ValueError(f"graph batch of {bs} rows above the {self.graph_max_bs} allocated")
        wrapper = self.graph_wrappers.get(bs)
        if wrapper is None:
            wrapper = self.provider.wrapper_cls(
                self.workspace, use_cuda_graph=True, qo_indptr=self.graph_qo_indptr[: bs + 1],
                kv_indptr=self.graph_kv_indptr[: bs + 1], kv_indices=self.graph_kv_indices,
                kv_len_arr=self.graph_kv_len[:bs], backend="auto")
            self.graph_wrappers[bs] = wrapper
        return wrapper

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens, forward_mode, *,
                                                 kv_width=None) -> None:
        """Build bucket ``bs``'s wrapper over the fixed buffers and plan it (before the capture, on the host)."""
        self.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens[:bs].tolist(),
                                                     forward_mode)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_cpu,
                                                forward_mode, *, kv_width=None) -> None:
        """Plan bucket ``bs``'s wrapper for rows ``[0, bs)`` (``seq_lens_cpu`` their lengths; ``kv_width`` is
        ignored: the kernel reads each row up to its ``kv_len``).

        Raises:
            ValueError: ``bs`` above the allocated rows.
        """
        self._plan(self._graph_wrapper(bs), [1] * bs, req_pool_indices[:bs], list(seq_lens_cpu[:bs]),
                   causal=False)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """1: a padding row attends to one slot of its (row 0) table."""
        return 1
