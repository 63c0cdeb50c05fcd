"""Python entry points of the fused CPU kernels (``csrc/*.c``), each replacing a run of small torch operators
on the decode path of a CPU rank.

Callers ask :func:`enabled_for` with the float tensors they would pass; when it says no (not float32, not on the
CPU, inside ``torch.compile`` tracing, the library switched off or not buildable), they run their torch path.
The functions below check every shape, stride and dtype the C code relies on and raise ``ValueError`` when one
does not hold, and ``IndexError`` when an index (position, KV slot) is out of range, before anything is written:
a bad argument never reaches memory it should not.
"""

from __future__ import annotations

import torch

from raymoe.platform.cpu.kernels import build

_F32 = torch.float32
_SAMPLE_BLOCK = 64  # SAMPLE_BLOCK of csrc/sampling.c: the sampling kernel's scratch holds one sum per block


def enabled_for(*tensors: torch.Tensor) -> bool:
    """True when the kernels can take these float tensors: all float32 on the CPU, outside ``torch.compile``
    tracing, and the library is loaded (built on first use)."""
    for t in tensors:
        if t.dtype is not _F32 or not t.is_cpu:  # is_cpu: False for meta and CUDA tensors
            return False
    return build.load() is not None and not torch.compiler.is_compiling()


def lib():
    """The loaded kernel library (``ctypes.CDLL``). Raises RuntimeError: it is not loaded."""
    loaded = build.load()
    if loaded is None:
        raise RuntimeError("fused CPU kernels are not loaded; check enabled_for() first")
    return loaded


def need(cond: bool, what) -> None:
    """Raise ValueError(what) unless ``cond``; ``what`` is a string or a callable returning one (messages that
    format shapes are only built when they are raised)."""
    if not cond:
        raise ValueError(f"fused CPU kernel: {what() if callable(what) else what}")


def _rows(x: torch.Tensor, name: str, dim: int) -> None:
    need(x.dim() == 2 and x.shape[1] == dim and x.stride(1) == 1,
          lambda: f"{name} must be [T, {dim}] with unit last stride, got {tuple(x.shape)} strides {x.stride()}")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019) of ``x + residual`` (or of ``x`` when ``residual`` is None).

    Shapes: ``x``, ``residual`` [T, D] float32 (rows may be strided); ``weight`` [D] float32 contiguous.
    Returns ``(weight * h / sqrt(mean(h^2) + eps), h)``: the first a new [T, D] contiguous tensor; ``h`` the sum
    ``x + residual`` as a new [T, D] contiguous tensor, or ``x`` itself (not a copy) when ``residual`` is None.
    Raises:
        ValueError: a shape or stride the kernel cannot take.
    """
    d = weight.shape[0]
    need(weight.dim() == 1 and weight.is_contiguous(), "weight must be a contiguous [D] tensor")
    _rows(x, "x", d)
    out = torch.empty((x.shape[0], d), dtype=torch.float32)
    if residual is None:
        h, r_ptr, r_stride, s_ptr = x, None, 0, None
    else:
        _rows(residual, "residual", d)
        need(residual.shape[0] == x.shape[0], "x and residual must have the same rows")
        h = torch.empty_like(out)
        r_ptr, r_stride, s_ptr = residual.data_ptr(), residual.stride(0), h.data_ptr()
    lib().raymoe_add_rms_norm_f32(x.data_ptr(), x.stride(0), r_ptr, r_stride, s_ptr, d, weight.data_ptr(),
                                   out.data_ptr(), d, x.shape[0], d, eps)
    return out, h


def qk_norm_rope_(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """In place: per-head RMSNorm (when ``norm_weight`` is given), then neox RoPE (Su et al. 2021, rotate
    halves) of every head of ``x`` at its token's position.

    Shapes: ``x`` [T, H, D] float32 with D contiguous and heads adjacent (token stride free); ``norm_weight``
    [H, D] float32 contiguous; ``cos``/``sin`` [P, D] float32 contiguous tables; ``positions`` [T] int64.
    Returns ``x``. Raises:
        ValueError: a shape, stride or dtype the kernel cannot take (D odd or above 1024 included).
        IndexError: a position outside ``[0, P)``.
    """
    t, h, d = x.shape
    need(x.stride(2) == 1 and x.stride(1) == d, lambda: f"x must have contiguous heads, got strides {x.stride()}")
    need(d % 2 == 0 and d <= 1024, lambda: f"head dim must be even and <= 1024, got {d}")
    need(cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == d and cos.is_contiguous()
          and sin.is_contiguous(), "cos/sin must be contiguous [P, D] tables")
    need(positions.dtype == torch.int64 and positions.is_contiguous() and positions.shape == (t,),
          "positions must be a contiguous [T] int64 tensor")
    w_ptr = None
    if norm_weight is not None:
        need(tuple(norm_weight.shape) == (h, d) and norm_weight.is_contiguous(), "norm_weight must be [H, D]")
        w_ptr = norm_weight.data_ptr()
    rc = lib().raymoe_qk_norm_rope_f32(x.data_ptr(), x.stride(0), t, h, d, w_ptr, eps, cos.data_ptr(),
                                        sin.data_ptr(), positions.data_ptr(), cos.shape[0])
    if rc != 0:
        raise IndexError(f"a position lies outside the rotary table of {cos.shape[0]} rows")
    return x


def _kv_rows(x: torch.Tensor, name: str, hkv: int, d: int) -> None:
    need(x.dim() == 3 and x.shape[1:] == (hkv, d) and x.stride(2) == 1 and x.stride(1) == d,
          lambda: f"{name} must be [T, {hkv}, {d}] with contiguous heads, got {tuple(x.shape)} strides {x.stride()}")


def kv_store(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
    """``k_buf[loc] = k`` and ``v_buf[loc] = v``.

    Shapes: ``k``, ``v`` [T, Hkv, D] float32 with contiguous heads; ``loc`` [T] int64 contiguous; ``k_buf``,
    ``v_buf`` [slots, Hkv, D] float32 contiguous.
    Raises:
        ValueError: a shape, stride or dtype the kernel cannot take.
        IndexError: a slot outside ``[0, slots)``.
    """
    need(k_buf.is_contiguous() and v_buf.is_contiguous() and k_buf.shape == v_buf.shape and k_buf.dim() == 3,
          "k_buf and v_buf must be contiguous [slots, Hkv, D] tensors of one shape")
    slots, hkv, d = k_buf.shape
    _kv_rows(k, "k", hkv, d)
    _kv_rows(v, "v", hkv, d)
    t = k.shape[0]
    need(v.shape[0] == t and loc.shape == (t,) and loc.dtype == torch.int64 and loc.is_contiguous(),
          "loc must be a contiguous [T] int64 tensor matching k and v")
    rc = lib().raymoe_kv_store_f32(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), loc.data_ptr(), t,
                                    hkv * d, k_buf.data_ptr(), v_buf.data_ptr(), slots)
    if rc != 0:
        raise IndexError(f"a KV slot lies outside [0, {slots})")


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Paged decode attention, one query token per row, grouped-query heads.

    Row b attends to its first ``n_b = min(max(seq_lens[b], 1), L)`` cache slots ``kv_indices[b, :n_b]``
    (a padded row with seq_len below 1 attends to one slot, as under SDPA's graph padding); query head h reads
    kv head ``h // (Hq // Hkv)``; softmax of ``scale * q.k``.
    Shapes: ``q`` [bs, Hq, D] float32 with contiguous heads; ``k_buf``, ``v_buf`` [slots, Hkv, D] float32
    contiguous; ``kv_indices`` [bs, L] int64 with unit last stride; ``seq_lens`` [bs] int64 contiguous.
    Returns [bs, Hq, D] float32 contiguous. Raises:
        ValueError: a shape, stride or dtype the kernel cannot take (Hq not a multiple of Hkv included).
        IndexError: an attended slot outside ``[0, slots)``.
    """
    need(kv_indices.dim() == 2 and kv_indices.shape[0] == q.shape[0],
          "kv_indices must have one row per query row")
    return _paged_attention(q, k_buf, v_buf, kv_indices, None, seq_lens, scale)


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
                     token_rows: torch.Tensor, token_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Paged causal attention for extend (prefill) tokens whose keys/values are already in the cache.

    Token t belongs to request ``token_rows[t]`` and sits at position ``token_lens[t] - 1`` of it, so it attends
    to that request's slots ``kv_indices[token_rows[t], :token_lens[t]]``: the cached prefix and the new tokens
    up to itself. The same arithmetic as :func:`decode_attention`, with the row of slots shared by a request's
    tokens instead of copied per token.
    Shapes: ``q`` [T, Hq, D] float32 with contiguous heads; ``k_buf``, ``v_buf`` [slots, Hkv, D] float32
    contiguous; ``kv_indices`` [R, L] int64 with unit last stride; ``token_rows`` and ``token_lens`` [T] int64
    contiguous. Returns [T, Hq, D] float32 contiguous. Raises:
        ValueError: a shape, stride or dtype the kernel cannot take.
        IndexError: a token row outside ``[0, R)`` or an attended slot outside ``[0, slots)``.
    """
    need(token_rows.shape == (q.shape[0],) and token_rows.dtype == torch.int64 and token_rows.is_contiguous(),
          "token_rows must be a contiguous [T] int64 tensor")
    need(kv_indices.dim() == 2, "kv_indices must be [R, L]")
    return _paged_attention(q, k_buf, v_buf, kv_indices, token_rows, token_lens, scale)


def _paged_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
                     rows: torch.Tensor | None, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    bs, hq, d = q.shape
    need(k_buf.is_contiguous() and v_buf.is_contiguous() and k_buf.shape == v_buf.shape and k_buf.dim() == 3
          and k_buf.shape[2] == d, "k_buf and v_buf must be contiguous [slots, Hkv, D] tensors of one shape")
    slots, hkv, _ = k_buf.shape
    need(hq % hkv == 0, lambda: f"query heads {hq} must be a multiple of kv heads {hkv}")
    need(q.stride(2) == 1 and q.stride(1) == d, lambda: f"q must have contiguous heads, got strides {q.stride()}")
    need(kv_indices.dtype == torch.int64 and kv_indices.stride(1) == 1,
          "kv_indices must be int64 with unit last stride")
    need(seq_lens.shape == (bs,) and seq_lens.dtype == torch.int64 and seq_lens.is_contiguous(),
          "seq_lens must be a contiguous [bs] int64 tensor")
    out = torch.empty((bs, hq, d), dtype=torch.float32)
    if bs == 0:
        return out
    rc = lib().raymoe_paged_attention_f32(q.data_ptr(), q.stride(0), k_buf.data_ptr(), v_buf.data_ptr(),
                                           kv_indices.data_ptr(), kv_indices.stride(0), kv_indices.shape[1],
                                           kv_indices.shape[0], None if rows is None else rows.data_ptr(),
                                           seq_lens.data_ptr(), bs, hq, hkv, d, scale, out.data_ptr(), slots)
    if rc == -1:
        raise IndexError(f"an attended KV slot lies outside [0, {slots})")
    if rc == -3:
        raise IndexError(f"a token row lies outside [0, {kv_indices.shape[0]})")
    if rc != 0:
        raise MemoryError("paged attention could not allocate its score buffer")
    return out


def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row, without candidate filters: row b with ``temperatures[b] == 0`` takes its first maximum,
    any other row the inverse CDF of ``softmax(logits[b] / temperatures[b])`` at ``uniforms[b]``: the first token
    whose running weight exceeds ``uniforms[b]`` times the total (the same rule as ``Sampler._draw``; a
    zero-probability token is never chosen). Replaces the softmax, cumulative sum, search and greedy argmax
    operators of a step (about 0.5 ms at [8, 8192] against 0.05 ms here).

    Shapes: ``logits`` [bs, V] float32 with unit last stride; ``temperatures`` and ``uniforms`` [bs] float32
    contiguous (temperatures >= 0, uniforms in [0, 1)). Returns [bs] int64 token ids. Raises:
        ValueError: a shape, stride or dtype the kernel cannot take, or a negative temperature.
    """
    bs, vocab = logits.shape
    need(logits.stride(1) == 1 and vocab > 0, "logits must be [bs, V] with V > 0 and unit last stride")
    for name, t in (("temperatures", temperatures), ("uniforms", uniforms)):
        need(t.shape == (bs,) and t.dtype is _F32 and t.is_contiguous() and t.is_cpu,
              lambda name=name: f"{name} must be a contiguous [bs] float32 CPU tensor")
    need(bs == 0 or float(temperatures.min()) >= 0.0, "temperatures must be >= 0")
    ids = torch.empty(bs, dtype=torch.int64)
    if bs:
        scratch = torch.empty(vocab + -(-vocab // _SAMPLE_BLOCK), dtype=_F32)
        lib().raymoe_sample_rows_f32(logits.data_ptr(), logits.stride(0), bs, vocab, temperatures.data_ptr(),
                                      uniforms.data_ptr(), scratch.data_ptr(), ids.data_ptr())
    return ids


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing with greedy top-k (Qwen3-MoE, Mixtral, DeepSeek-V2 ``greedy``): the ``top_k`` most
    probable experts of each token, their probabilities (renormalized to sum 1 when ``renormalize``) times
    ``scale``; ties go to the lower expert id.

    Shapes: ``logits`` [T, E] float32 with unit last stride. Returns ``(weights, ids)``: float32 and int64
    [T, top_k], most probable first. Raises:
        ValueError: ``top_k`` outside ``[1, E]`` or a layout the kernel cannot take.
    """
    need(logits.dim() == 2 and logits.stride(1) == 1, "logits must be [T, E] with unit last stride")
    t, e = logits.shape
    need(1 <= top_k <= e, lambda: f"top_k must lie in [1, {e}], got {top_k}")
    weights = torch.empty((t, top_k), dtype=torch.float32)
    ids = torch.empty((t, top_k), dtype=torch.int64)
    lib().raymoe_topk_softmax_f32(logits.data_ptr(), logits.stride(0), t, e, top_k, int(renormalize), scale,
                                   weights.data_ptr(), ids.data_ptr())
    return weights, ids


def moe_routed_rows(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, first_expert: int,
                    w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Routed SwiGLU experts (Shazeer 2020) over token rows in blocks, reading the routing itself: row
    ``(b, m)`` answers ``sum_j topk_weights[b, m, j] * expert_{topk_ids[b, m, j]}(x[b, m])`` over its picks among
    this rank's experts ``[first_expert, first_expert + E)``, in expert order; one GEMV pair per routed pair, where
    a batched GEMM would run every expert over every row. Ids outside the range (other ranks' experts, padding)
    are skipped, and a row with no pick here answers 0 without its ``x`` or weights being read.

    Shapes: ``x`` [B, M, H], ``topk_ids`` [B, M, k] int64, ``topk_weights`` [B, M, k] float32, each with a unit
    last stride (blocks and rows strided freely); ``w13`` [E, 2I, H] (gate rows, then up rows) and ``w2``
    [E, H, I] float32 contiguous. Returns [B * M, H] float32 contiguous.
    Raises:
        ValueError: a shape, stride or dtype the kernel cannot take.
    """
    need(w13.dim() == 3 and w2.dim() == 3 and w13.is_contiguous() and w2.is_contiguous(),
          "w13 and w2 must be contiguous [E, 2I, H] and [E, H, I] tensors")
    e, two_i, h = w13.shape
    need(two_i % 2 == 0 and tuple(w2.shape) == (e, h, two_i // 2),
          lambda: f"w2 must be [E, H, I], got {tuple(w2.shape)}")
    need(x.dim() == 3 and x.shape[2] == h and x.stride(2) == 1, lambda: f"x must be [B, M, {h}] with unit last "
          f"stride, got {tuple(x.shape)} strides {x.stride()}")
    b, m, _ = x.shape
    need(topk_ids.dim() == 3 and topk_ids.shape[:2] == (b, m) and topk_ids.dtype == torch.int64
          and topk_ids.stride(2) == 1, "topk_ids must be [B, M, k] int64 with unit last stride")
    need(topk_weights.shape == topk_ids.shape and topk_weights.stride(2) == 1,
          "topk_weights must be [B, M, k] with unit last stride")
    out = torch.empty((b * m, h), dtype=torch.float32)
    rc = lib().raymoe_moe_routed_rows_f32(
        x.data_ptr(), x.stride(0), x.stride(1), topk_ids.data_ptr(), topk_ids.stride(0), topk_ids.stride(1),
        topk_weights.data_ptr(), topk_weights.stride(0), topk_weights.stride(1), b, m, topk_ids.shape[2],
        first_expert, e, w13.data_ptr(), w2.data_ptr(), h, two_i // 2, out.data_ptr())
    if rc != 0:
        raise MemoryError("routed experts could not allocate their scratch buffers")
    return out


def fp8_dequant(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block dequantization of an FP8 weight in one call: ``weight`` ``float8_e4m3fn`` [..., N, K] and ``scale``
    float32 [..., ceil(N / bn), ceil(K / bk)], both contiguous on the CPU -> float32 [..., N, K] with
    ``out[..., i, j] = weight[..., i, j] * scale[..., i // bn, j // bk]`` (exact: one rounding, as torch's
    ``weight.float() * scale``). torch converts float8 to float32 element by element (about 24 ns each on the CI
    machine); the kernel reads a 256-entry table."""
    n, k = weight.shape[-2:]
    bn, bk = block
    grid = (*weight.shape[:-2], -(-n // bn), -(-k // bk))
    need(weight.dtype == torch.float8_e4m3fn and weight.is_cpu and weight.is_contiguous(),
         "weight must be a contiguous CPU float8_e4m3fn tensor")
    need(scale.dtype is _F32 and scale.is_cpu and scale.is_contiguous() and tuple(scale.shape) == grid,
         lambda: f"scale must be contiguous float32 {grid}, got {scale.dtype} {tuple(scale.shape)}")
    out = torch.empty(weight.shape, dtype=torch.float32)
    groups = weight.numel() // max(n * k, 1)
    if out.numel():
        lib().raymoe_fp8_dequant_f32(weight.data_ptr(), groups, n, k, scale.data_ptr(), bn, bk, out.data_ptr())
    return out
