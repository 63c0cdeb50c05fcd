"""A CPU conformance double of vLLM's ``vllm.vllm_flash_attn.flash_attn_varlen_func`` (paged-KV path).

Same signature as the fork's Python wrapper (``vllm_flash_attn/flash_attn_interface.py``), the same argument
checks as the wrapper (``AssertionError``, ``ValueError``, ``NotImplementedError``) and as the FA2 C++ entry
``mha_varlen_fwd`` (``RuntimeError``), the same output layout, computed in plain torch:

* q [total_q, Hq, D]; k, v [num_blocks, block_size, Hkv, D] (paged: ``block_table`` given); out like q;
* ``cu_seqlens_q`` [bs + 1], ``seqused_k`` [bs], ``block_table`` [bs, max_blocks]: int32, contiguous (the table:
  contiguous last dim); q/k/v/out: contiguous last dim (the wrapper makes q/k/v so, like ``maybe_contiguous``);
* ``block_size % 16 == 0``; ``Hq % Hkv == 0``; head dim <= 256; fp16/bf16 with matching k/v/out dtypes;
* ``causal=True`` aligns the mask to the bottom right: query ``t`` of a sequence with ``q_len`` queries and
  ``k_len = seqused_k`` keys sees keys ``[0, k_len - q_len + t]``; a query that sees no key gets zeros.
* ``window_size=(left, right)`` (the wrapper asserts two entries; -1: unbounded; ``causal`` sets right to 0): query
  ``t`` sees keys ``[t + k_len - q_len - left, t + k_len - q_len + right]`` (the docstring of the fork's wrapper).
* ``s_aux`` [Hq] (attention sinks): the wrapper raises ``NotImplementedError("FA2 does not support s_aux")`` on
  FA2; the FA3 entry (``hopper/flash_api.cpp``) checks at most 64 query heads, equal q/v head dims, bfloat16, shape
  [Hq], contiguous, q's device (its Hopper-only check cannot be modeled here). Each head's sink logit joins the
  softmax's denominator and has no value: ``p_j = exp(s_j) / (exp(s_aux[h]) + sum_i exp(s_i))``.

Deliberate differences: tensors must share q's device instead of being CUDA; ``allow_float32=True`` also accepts
float32 (so engine parity can run in fp32); and it is stricter than the kernel where the kernel would silently read
out of bounds or skip work (a query or key length above ``max_seqlen_q`` / ``max_seqlen_k``, a block id out of
range, a table too narrow for ``seqused_k``). Features raymoe does not use (dropout, softcap, ALiBi, the non-paged
``cu_seqlens_k`` path, FA3 extras, the log-sum-exp of a call with sinks) raise ``NotImplementedError``.
"""

from __future__ import annotations

import torch

_FA_DTYPES = (torch.float16, torch.bfloat16)


def _check(cond: bool, msg: str) -> None:
    """The C++ side's ``TORCH_CHECK``: a ``RuntimeError``."""
    if not cond:
        raise RuntimeError(msg)


class FlashAttnDouble:
    """Callable with ``flash_attn_varlen_func``'s signature; ``calls`` counts the calls that computed something."""

    def __init__(self, allow_float32: bool = False):
        self.dtypes = _FA_DTYPES + ((torch.float32,) if allow_float32 else ())
        self.calls = 0

    def __call__(self, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                 q_v=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                 alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
                 return_softmax_lse=False, out=None, scheduler_metadata=None, q_descale=None, k_descale=None,
                 v_descale=None, num_splits: int = 0, fa_version: int = 2, s_aux=None, cp_world_size=1, cp_rank=0,
                 cp_tot_seqused_k=None):
        # The Python wrapper's checks.
        assert cu_seqlens_k is not None or seqused_k is not None, "cu_seqlens_k or seqused_k must be provided"
        assert cu_seqlens_k is None or seqused_k is None, \
            "cu_seqlens_k and seqused_k cannot be provided at the same time"
        assert block_table is None or seqused_k is not None, "seqused_k must be provided if block_table is provided"
        if fa_version not in (2, 3):
            raise ValueError(f"Unsupported FA version: {fa_version}")
        if fa_version == 2 and s_aux is not None:
            raise NotImplementedError("FA2 does not support s_aux")
        if fa_version == 2 and num_splits > 1:
            raise NotImplementedError("FA2 does not support num_splits > 1")
        if window_size is None:
            window_size = (-1, -1)
        else:
            assert len(window_size) == 2
        unused = (q_v, alibi_slopes, scheduler_metadata, q_descale, k_descale, v_descale, cp_tot_seqused_k)
        if block_table is None or dropout_p or softcap or cp_world_size != 1 or any(x is not None for x in unused):
            raise NotImplementedError("the double models only the paged-KV path without dropout/softcap/ALiBi")
        if s_aux is not None and return_softmax_lse:
            raise NotImplementedError("the double does not model the log-sum-exp of a call with s_aux")
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5
        q, k, v = (x.contiguous() if x.stride(-1) != 1 else x for x in (q, k, v))
        self._check_args(q, k, v, cu_seqlens_q, seqused_k, block_table, out)
        if s_aux is not None:  # the FA3 entry's checks
            _check(q.shape[1] <= 64, "We only support query heads <= 64 with S aux")
            _check(q.shape[-1] == v.shape[-1], "We don't support S aux with hdim != hdim_v")
            _check(s_aux.dtype == torch.bfloat16, "We only support bf16 dtype for S aux.")
            _check(s_aux.device == q.device, "s_aux must be on the same device")
            _check(tuple(s_aux.shape) == (q.shape[1],), "s_aux must have shape (num_heads)")
            _check(s_aux.is_contiguous(), "s_aux must be contiguous")
        if out is None:
            out = torch.empty_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
        left, right = int(window_size[0]), 0 if causal else int(window_size[1])
        self._attend(q, k, v, int(max_seqlen_q), cu_seqlens_q, int(max_seqlen_k), seqused_k, block_table,
                     float(softmax_scale), (left, right), out, lse, s_aux)
        self.calls += 1
        return (out, lse) if return_softmax_lse else out

    def _check_args(self, q, k, v, cu_seqlens_q, seqused_k, block_table, out) -> None:
        """``mha_varlen_fwd``'s checks of dtypes, layouts and shapes (paged KV)."""
        _check(q.dtype in self.dtypes, "FlashAttention only support fp16 and bf16 data type")
        _check(k.dtype == q.dtype, "query and key must have the same dtype")
        _check(v.dtype == q.dtype, "query and value must have the same dtype")
        _check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
        _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
        _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
        _check(cu_seqlens_q.is_contiguous(), "cu_seqlens_q must be contiguous")
        for x in (k, v, cu_seqlens_q, seqused_k, block_table) + ((out,) if out is not None else ()):
            _check(x.device == q.device, "all tensors must be on q's device")
        _check(q.dim() == 3 and k.dim() == 4, "q must be [total_q, H, D] and paged k/v [blocks, block_size, Hkv, D]")
        total_q, num_heads, head_dim = q.shape
        num_blocks, block_size, num_heads_k = k.shape[:3]
        batch_size = cu_seqlens_q.numel() - 1
        _check(block_size % 16 == 0, "Paged KV cache block size must be divisible by 16")
        _check(batch_size > 0, "batch size must be positive")
        _check(head_dim <= 256, "FlashAttention forward only supports head dimension at most 256")
        _check(num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query")
        _check(tuple(k.shape) == (num_blocks, block_size, num_heads_k, head_dim), "k must have shape "
               "(num_blocks, page_block_size, num_heads_k, head_size_og)")
        _check(tuple(v.shape) == tuple(k.shape), "v must have shape (num_blocks, page_block_size, num_heads_k, "
               "head_size_og)")
        _check(block_table.dim() == 2 and block_table.shape[0] == batch_size,
               "block_table must have shape (batch_size, max_num_blocks_per_seq)")
        _check(tuple(cu_seqlens_q.shape) == (batch_size + 1,), "cu_seqlens_q must have shape (batch_size + 1)")
        _check(seqused_k.dtype == torch.int32, "seqused_k must have dtype int32")
        _check(seqused_k.is_contiguous(), "seqused_k must be contiguous")
        _check(tuple(seqused_k.shape) == (batch_size,), "seqused_k must have shape (batch_size)")
        if out is not None:
            _check(out.dtype == q.dtype, "Output must have the same dtype as inputs")
            _check(out.stride(-1) == 1, "Output tensor must have contiguous last dimension")
            _check(tuple(out.shape) == (total_q, num_heads, head_dim), "out must have shape (total_q, H, D)")

    @staticmethod
    def _attend(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, block_table, scale, window, out,
                lse, s_aux) -> None:
        """Each sequence: gather its keys/values through the block table, softmax in float32 over the keys inside
        ``window`` = (left, right) of each query's diagonal (-1: unbounded), with the sink logits when given."""
        block_size, num_heads_k = k.shape[1], k.shape[2]
        group = q.shape[1] // num_heads_k
        cu, used = cu_seqlens_q.tolist(), seqused_k.tolist()
        for i, k_len in enumerate(used):
            q0, q1 = cu[i], cu[i + 1]
            q_len = q1 - q0
            _check(0 <= q_len <= max_seqlen_q and q1 <= q.shape[0], f"sequence {i}: {q_len} queries, bad cu_seqlens_q")
            _check(0 <= k_len <= max_seqlen_k, f"sequence {i}: seqused_k {k_len} above max_seqlen_k {max_seqlen_k}")
            n_blocks = -(-k_len // block_size)
            _check(n_blocks <= block_table.shape[1], f"sequence {i}: block_table too narrow for {k_len} keys")
            blocks = block_table[i, :n_blocks].long()
            _check(bool(((blocks >= 0) & (blocks < k.shape[0])).all()), f"sequence {i}: block id out of range")
            keys = k[blocks].reshape(-1, num_heads_k, k.shape[3])[:k_len].float()      # [k_len, Hkv, D]
            values = v[blocks].reshape(-1, num_heads_k, v.shape[3])[:k_len].float()
            keys = keys.repeat_interleave(group, dim=1)                                 # [k_len, Hq, D]
            values = values.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), keys) * scale        # [Hq, q_len, k_len]
            diag = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)      # each query's diagonal key
            key = torch.arange(k_len, device=q.device)[None, :]
            if window[1] >= 0:
                scores = scores.masked_fill(key > diag + window[1], float("-inf"))
            if window[0] >= 0:
                scores = scores.masked_fill(key < diag - window[0], float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)                                    # [Hq, q_len]
            if s_aux is not None:                                                        # the sink joins the sum
                row_lse = torch.logaddexp(row_lse, s_aux.float()[:, None].expand_as(row_lse))
            probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)               # rows seeing no key: 0
            out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)
            lse[:, q0:q1] = row_lse
