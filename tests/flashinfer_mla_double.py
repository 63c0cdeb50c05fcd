"""A CPU conformance double of FlashInfer's ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (fa2/fa3 paged path).

Same constructor, ``plan`` and ``run`` signatures as the wrapper (``flashinfer/mla/_core.py``), its Python checks
with the same exception types and messages, the C++ launcher's (``csrc/batch_mla_run.cu``: ``kv_indices`` int32),
the same output layout and the same state semantics, computed in plain torch:

* ``plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
  sm_scale, q_data_type, kv_data_type, use_profiler=False)``: ``kv_data_type`` fp16/bf16 (fp8 e4m3 is the
  library's Hopper-only path with scales, not modelled: ``NotImplementedError``); the index arrays go to the host
  (the plan info: ``qo_indptr``, ``kv_indptr``, ``kv_len_arr`` as they were at plan time). Without CUDA graphs the
  wrapper keeps ``kv_indices`` itself (``.to(device)`` of a tensor already there is the same tensor); with
  ``use_cuda_graph=True`` it copies all four into the buffers given to the constructor (``qo_indptr`` /
  ``kv_indptr`` / ``kv_len_arr`` of exactly ``bs + 1`` / ``bs`` elements: the batch size of a graph wrapper is
  fixed; ``kv_indices`` into the buffer's first elements) and ``run`` reads the ``kv_indices`` buffer as it is
  then, with the lengths of the last plan;
* ``run(q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, ...)``: ``q_nope``
  [n, num_heads, head_dim_ckv], ``q_pe`` [n, num_heads, head_dim_kpe] of the planned ``q_data_type``; ``ckv_cache``
  [num_pages, page_size, head_dim_ckv], ``kpe_cache`` [num_pages, page_size, head_dim_kpe] of the planned
  ``kv_data_type`` (any page/token strides, the last dim contiguous); returns ``out`` [n, num_heads, head_dim_ckv]
  (and ``lse`` [n, num_heads] float32, base 2 unless ``return_lse_base_on_e``);
* ``causal=True`` aligns the mask to the bottom right: query ``t`` of a request with ``q_len`` queries and
  ``kv_len`` keys sees keys ``[0, kv_len - q_len + t]``; the value is the latent part of the key row.

Deliberate differences, all stricter than the library where it would compute garbage silently: ``run`` before
``plan`` raises ``AttributeError`` as the library does (its ``_cached_module`` is missing); shapes the C++ side reads
without checking (``n`` against ``qo_indptr[-1]``, heads against the planned ``num_heads``, head dims against the
planned ones, ``kv_len >= 1``, page counts against ``ceil(kv_len / page_size)``, page ids within ``num_pages``,
``q_len <= kv_len`` for causal, which the library's tests skip as unsupported) raise ``RuntimeError``; index arrays
must be int32 (the kernels the library builds ahead of time use int32 indices); ``(head_dim_ckv, head_dim_kpe)``
must be one of the pairs the library builds ahead of time and tests, ``(512, 64)`` and ``(512, 0)`` (the JIT would
compile others, untested); q and kv share one 16-bit dtype (the ahead-of-time modules). ``allow_float32=True`` (a
class attribute) also accepts float32, so engine parity can run in fp32. The ``cutlass`` backend (another ``run``
layout) and the profiler are not modelled (``NotImplementedError``). Tensors must share the workspace's device
instead of being CUDA.
"""

from __future__ import annotations

import torch

_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)  # the wrapper's plan() allowlist
_HEAD_DIMS = ((512, 64), (512, 0))


def _check(cond: bool, msg: str) -> None:
    """The C++ side's ``TORCH_CHECK``: a ``RuntimeError``."""
    if not cond:
        raise RuntimeError(msg)


def _check_shape_dtype_device(x: torch.Tensor, shape, dtype, device, name: str) -> None:
    """``flashinfer.utils.check_shape_dtype_device``: ValueError on a mismatch."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"Invalid shape of {name}: expected {tuple(shape)}, got {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"Invalid dtype of {name}: expected {dtype}, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"Invalid device of {name}: expected {device}, got {x.device}")


class BatchMLAPagedAttentionWrapperDouble:
    """``BatchMLAPagedAttentionWrapper``'s API on CPU (module docstring). ``runs`` counts the runs of every
    instance of the class (subclass it per test for a fresh count)."""

    allow_float32 = False
    runs = 0

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        if backend == "cutlass":
            raise NotImplementedError("the double models the fa2/fa3 paged path, not the cutlass run layout")
        if backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"Unsupported backend: {backend}")
        self._use_cuda_graph = use_cuda_graph
        self._qo_indptr_buf = qo_indptr
        self._kv_indptr_buf = kv_indptr
        self._kv_indices_buf = kv_indices
        self._kv_len_arr_buf = kv_len_arr
        self._backend = "fa2" if backend == "auto" else backend

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int,
             causal: bool, sm_scale: float, q_data_type: torch.dtype, kv_data_type: torch.dtype,
             use_profiler: bool = False) -> None:
        kv_dtypes = _KV_DTYPES + ((torch.float32,) if self.allow_float32 else ())
        if kv_data_type not in kv_dtypes:
            raise ValueError(f"MLA kv_data_type {kv_data_type} is not supported. "
                             f"Supported dtypes: {list(kv_dtypes)}.")
        if head_dim_kpe < 0:
            raise ValueError(f"head_dim_kpe must be >= 0, got {head_dim_kpe}.")
        if kv_data_type == torch.float8_e4m3fn:
            raise NotImplementedError("the FP8 KV path (SM90, ckv/kpe scales) is not modelled")
        if use_profiler:
            raise NotImplementedError("the profiler is not modelled")
        allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if self.allow_float32 else ())
        _check(q_data_type in allowed and kv_data_type == q_data_type,
               f"MLA kernels are built for q and kv of one dtype among {allowed}, got q {q_data_type}, "
               f"kv {kv_data_type}")
        _check((head_dim_ckv, head_dim_kpe) in _HEAD_DIMS,
               f"MLA kernels are built for (head_dim_ckv, head_dim_kpe) in {_HEAD_DIMS}, got "
               f"({head_dim_ckv}, {head_dim_kpe})")
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_len_arr", kv_len_arr)):
            _check(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1,
                   f"{name} must be a 1-D int32 tensor")
        bs = kv_len_arr.shape[0]
        _check(qo_indptr.shape[0] == bs + 1 and kv_indptr.shape[0] == bs + 1,
               f"qo_indptr and kv_indptr need batch_size + 1 = {bs + 1} elements, got {qo_indptr.shape[0]} and "
               f"{kv_indptr.shape[0]}")
        _check(page_size >= 1, f"page_size must be >= 1, got {page_size}")
        qo_host, kv_host, len_host = qo_indptr.to("cpu"), kv_indptr.to("cpu"), kv_len_arr.to("cpu")
        q_lens, pages = qo_host.diff(), kv_host.diff()
        _check(int(qo_host[0]) == 0 and int(kv_host[0]) == 0 and bool((q_lens >= 0).all()),
               "qo_indptr and kv_indptr must start at 0 and not decrease")
        _check(bool((len_host >= 1).all()), "every kv_len must be >= 1")
        _check(torch.equal(pages, (len_host + page_size - 1) // page_size),
               "kv_indptr must give each request ceil(kv_len / page_size) pages")
        _check(kv_indices.shape[0] >= int(kv_host[-1]), f"kv_indices has {kv_indices.shape[0]} pages, kv_indptr "
                                                        f"needs {int(kv_host[-1])}")
        if causal:
            _check(bool((q_lens <= len_host).all()), "qo_len > kv_len is not supported for causal attention")
        if self._use_cuda_graph:
            for buf, src, name in ((self._qo_indptr_buf, qo_indptr, "qo_indptr"),
                                   (self._kv_indptr_buf, kv_indptr, "kv_indptr"),
                                   (self._kv_len_arr_buf, kv_len_arr, "kv_len_arr")):
                if buf is None:
                    raise AttributeError("'NoneType' object has no attribute 'copy_'")
                _check(buf.shape == src.shape, f"the CUDA-graph {name} buffer holds {tuple(buf.shape)}, "
                                               f"got {tuple(src.shape)}: its batch size is fixed")
                buf.copy_(src)
            if self._kv_indices_buf is None:
                raise AttributeError("'NoneType' object has no attribute 'copy_'")
            _check(kv_indices.shape[0] <= self._kv_indices_buf.shape[0],
                   f"{kv_indices.shape[0]} pages do not fit the CUDA-graph kv_indices buffer of "
                   f"{self._kv_indices_buf.shape[0]}")
            self._kv_indices_buf[: len(kv_indices)].copy_(kv_indices)
        else:
            self._kv_indices_buf = kv_indices.to(self.device)
        self._cached_module = "double"
        self._plan_info = (qo_host.clone(), kv_host.clone(), len_host.clone())
        self._num_heads, self._head_dim_ckv, self._head_dim_kpe = num_heads, head_dim_ckv, head_dim_kpe
        self._causal, self._page_size, self._sm_scale = causal, page_size, sm_scale
        self._q_data_type, self._kv_data_type = q_data_type, kv_data_type

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            profiler_buffer: torch.Tensor | None = None, kv_len: torch.Tensor | None = None,
            page_table: torch.Tensor | None = None, return_lse_base_on_e: bool = False,
            o_scale: float | None = None, *, ckv_scale: float | None = None,
            ckv_scale_arr: torch.Tensor | None = None, kpe_scale: float | None = None):
        if not hasattr(self, "_cached_module"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '_cached_module'")
        if o_scale is not None:
            raise ValueError("o_scale is only supported with the cutlass backend for now.")
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe)):
            if t.dtype != self._q_data_type:
                raise ValueError(f"{name}.dtype={t.dtype} does not match the planned q_data_type={self._q_data_type}.")
        for name, t in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            if t.dtype != self._kv_data_type:
                raise ValueError(f"{name}.dtype={t.dtype} does not match the planned "
                                 f"kv_data_type={self._kv_data_type}.")
        if ckv_scale is not None or ckv_scale_arr is not None or kpe_scale is not None:
            raise ValueError("ckv_scale / ckv_scale_arr / kpe_scale are only valid when kv_data_type is FP8.")
        if profiler_buffer is not None or kv_len is not None or page_table is not None:
            raise NotImplementedError("profiler_buffer, kv_len and page_table (cutlass) are not modelled")
        qo, kvp, lens = self._plan_info
        n, heads, ckv, kpe, page = int(qo[-1]), self._num_heads, self._head_dim_ckv, self._head_dim_kpe, self._page_size
        _check(tuple(q_nope.shape) == (n, heads, ckv), f"q_nope must be {(n, heads, ckv)} as planned, got "
                                                       f"{tuple(q_nope.shape)}")
        _check(tuple(q_pe.shape) == (n, heads, kpe), f"q_pe must be {(n, heads, kpe)}, got {tuple(q_pe.shape)}")
        pages = ckv_cache.shape[0]
        _check(ckv_cache.dim() == 3 and tuple(ckv_cache.shape[1:]) == (page, ckv),
               f"ckv_cache must be [num_pages, {page}, {ckv}], got {tuple(ckv_cache.shape)}")
        _check(tuple(kpe_cache.shape) == (pages, page, kpe),
               f"kpe_cache must be {(pages, page, kpe)}, got {tuple(kpe_cache.shape)}")
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            _check(t.device == self.device, f"{name} is on {t.device}, the workspace on {self.device}")
            _check(t.shape[-1] == 0 or t.stride(-1) == 1, f"{name} must have a contiguous last dimension")
        indices = self._kv_indices_buf
        _check(indices.dtype == torch.int32, "kv_indices must be int32")
        used = indices[: int(kvp[-1])].to("cpu").long()
        _check(bool(((used >= 0) & (used < pages)).all()), f"a page index lies outside [0, {pages})")
        if out is None:
            out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
        else:
            _check_shape_dtype_device(out, q_nope.shape, q_nope.dtype, q_nope.device, "out")
        if return_lse:
            if lse is None:
                lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=self.device)
            else:
                _check_shape_dtype_device(lse, q_nope.shape[:2], torch.float32, q_nope.device, "lse")
        for r in range(lens.shape[0]):
            q0, q1, kl = int(qo[r]), int(qo[r + 1]), int(lens[r])
            if q1 == q0:
                continue
            pg = used[int(kvp[r]):int(kvp[r + 1])]
            keys_c = ckv_cache[pg].reshape(-1, ckv)[:kl].float()                           # [kl, ckv]
            keys_p = kpe_cache[pg].reshape(-1, kpe)[:kl].float()
            s = (torch.einsum("qhd,kd->hqk", q_nope[q0:q1].float(), keys_c)
                 + torch.einsum("qhd,kd->hqk", q_pe[q0:q1].float(), keys_p)) * self._sm_scale
            if self._causal:
                ql = q1 - q0
                visible = torch.arange(kl)[None, :] <= torch.arange(ql)[:, None] + (kl - ql)
                s = s.masked_fill(~visible.to(s.device)[None], float("-inf"))
            out[q0:q1] = torch.einsum("hqk,kd->qhd", torch.softmax(s, dim=-1), keys_c).to(out.dtype)
            if return_lse:
                e = torch.logsumexp(s, dim=-1).transpose(0, 1)                                # [ql, H]
                lse[q0:q1] = e if return_lse_base_on_e else e / torch.log(torch.tensor(2.0))
        type(self).runs += 1
        return (out, lse) if return_lse else out
