"""The fused attention block of a CPU rank (``csrc/attn_block.c``): one kernel call per layer and step for what a
pre-norm decoder layer does between its input and its MoE dispatch, for decode steps and for extend/MIXED steps
whose tokens the paged kernel attends.

On a float32 CPU rank, a decode step of a small model spends most of its time in the framework's per-operator
overhead: the input RMSNorm, the qkv projection, q/k norm and RoPE, the KV store, paged attention, the o
projection, the residual add and post-attention RMSNorm, the router projection and the top-k make about twenty
operator calls per layer (about 0.3 ms at 8 tokens of the benchmark model, for under 0.05 ms of arithmetic). The
kernel does them all over the layer's weights in place.

:class:`AttnBlockPlan` is built once per layer from its weights (checked here once: shapes, dtype, contiguity;
the norm weights and rotary tables are read in place, the projections from copies packed for ``csrc/gemm.c``);
each call checks only the step's tensors. The C code checks every index it reads through (positions, KV slots,
token rows) before it writes anything.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from raymoe.platform.cpu.kernels import cpu_ops, packed_linear

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

ATTN_BLOCK_MAX_MACS = 1 << 23
"""Most multiply-accumulates (``T * macs_per_row``: the qkv, o and router projections) one call may take; above
it the layer runs its ops one by one. Set for the block's earlier GEMM (a 4 x 16 register tile
over transposed weights, about 20 GMAC/s on one core of the benchmark machine) matched torch's at [8, 128] x
[128, 256] and took 1.5-2x its time from about a million MACs on, while the operator overhead it saves stays about
constant. Whole decode steps of the peers' tiny model on one rank, block on / off: bs 16 3.9 / 5.1 ms, bs 64 7.1 /
7.9 ms, bs 256 22.1 / 21.4 ms (0.8 / 3.2 / 12.8 M MACs per layer call); this bound (8.4 M) keeps bs 64 and stops
bs 256. The block now calls the packed GEMM (``csrc/gemm.c``, 2-3x that rate at these sizes), so the bound is
conservative; it was not measured again."""


class AttnBlockParams(ctypes.Structure):
    """``raymoe_attn_block_params`` of ``csrc/attn_block.c`` (same field order)."""

    _fields_ = [("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("experts", _I64),
                ("top_k", _I64), ("renorm", _I64), ("table_rows", _I64), ("norm_eps", _F32), ("qk_eps", _F32),
                ("scale", _F32), ("routed_scale", _F32), ("ln1_w", _P), ("w_qkv_p", _P), ("qk_norm_w", _P),
                ("cos_t", _P), ("sin_t", _P), ("w_o_p", _P), ("ln2_w", _P), ("w_gate_p", _P)]


ATTN_BLOCK_MIN_ROWS = 8
"""A layer gets a plan only if a step of this many rows fits :data:`ATTN_BLOCK_MAX_MACS`: a model the block could
serve only at a batch of one or two gains nothing from it (and where a projection comes without a packed copy, the
plan makes one, at most ``MAX_MACS / MIN_ROWS`` floats, 4 MiB, per layer)."""


def macs_per_row(w_qkv: torch.Tensor, w_o: torch.Tensor, w_gate: torch.Tensor | None) -> int:
    """Multiply-accumulates of the block's three projections for one token (``w_qkv`` [N, H], ``w_o`` [H, K],
    ``w_gate`` [E, H] or None)."""
    return w_qkv.shape[1] * (w_qkv.shape[0] + w_o.shape[1] + (0 if w_gate is None else w_gate.shape[0]))


def plan_fits(weights: dict, router: dict) -> bool:
    """Whether a layer with these :class:`AttnBlockPlan` keyword arguments (``w_qkv``, ``w_o``, optional
    ``w_gate``) should get a plan: its :func:`macs_per_row` times :data:`ATTN_BLOCK_MIN_ROWS` within
    :data:`ATTN_BLOCK_MAX_MACS`."""
    per_row = macs_per_row(weights["w_qkv"], weights["w_o"], router.get("w_gate"))
    return per_row * ATTN_BLOCK_MIN_ROWS <= ATTN_BLOCK_MAX_MACS


@dataclass(frozen=True)
class BlockAttentionInputs:
    """What the block's attention reads for one layer and step (from the attention backend's metadata).

    Attributes:
        k_buf, v_buf: the layer's cache, [slots, Hkv, D] float32 contiguous.
        kv_indices: [R, L] int64 slot lists (unit last stride): a decode step's row per token (R = T), or an
            extend step's ``ReqToTokenPool`` table (its rows named by ``token_rows``).
        token_rows: [T] int64 table row of each token (None: row t for token t).
        lens: [T] int64 slots each token attends to: a decode token's sequence length, an extend token's
            position + 1 (causal).
    """

    k_buf: torch.Tensor
    v_buf: torch.Tensor
    kv_indices: torch.Tensor
    token_rows: torch.Tensor | None
    lens: torch.Tensor


def _check(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    cpu_ops.need(t.dtype is torch.float32 and t.is_cpu and t.is_contiguous() and tuple(t.shape) == shape,
                  lambda: f"{name} must be a contiguous float32 CPU tensor of shape {shape}, got "
                          f"{tuple(t.shape)} {t.dtype} on {t.device}")
    return t


def _packed(w: torch.Tensor, given: packed_linear.PackedWeight | None) -> packed_linear.PackedWeight:
    """``given`` when it is a packed copy of ``w``'s sizes, a fresh one when None. Raises ValueError: other sizes."""
    if given is None:
        return packed_linear.pack(w)
    cpu_ops.need(given.groups == 1 and (given.out_features, given.in_features) == tuple(w.shape),
                 lambda: f"packed copy [{given.out_features}, {given.in_features}] does not match {tuple(w.shape)}")
    return given


class AttnBlockPlan:
    """One layer's weights for :meth:`__call__` (Qwen3-MoE / Mixtral-style GQA attention, tp = 1). The norm
    weights and rotary tables are read in place; the kernel's GEMM reads the three projections packed: the copies
    their layers keep (``w_qkv_packed``, ``w_o_packed``, ``w_gate_packed``, made at load), or copies packed here
    where none is given (:func:`~raymoe.platform.cpu.kernels.packed_linear.pack`). The owner builds a new plan after
    it loads new weights.

    Args:
        ln1_w, ln2_w: [H] input and post-attention RMSNorm weights; norm_eps: their epsilon.
        w_qkv: [(Hq + 2 Hkv) D, H] q, k then v projection rows (no bias). w_o: [H, Hq D] (no bias).
        qk_norm_w: [Hq + Hkv, D] per-head q then k norm weights (None: no q/k norm); qk_eps: their epsilon.
        cos, sin: [P, D] neox rotary tables. heads, kv_heads, head_dim: Hq, Hkv, D; scale: the softmax scale.
        w_gate: [E, H] router weights (None: no router, a dense MLP follows); top_k, renorm, routed_scale: softmax
            greedy routing (``cpu_ops.topk_softmax``).
        w_qkv_packed, w_o_packed, w_gate_packed: packed copies of those weights (None: packed here).
    Raises:
        ValueError: a weight of the wrong shape, dtype, device or layout, a packed copy of other sizes, or ``top_k``
            outside ``[1, E]``.
    """

    def __init__(self, *, ln1_w: torch.Tensor, ln2_w: torch.Tensor, norm_eps: float, w_qkv: torch.Tensor,
                 w_o: torch.Tensor, qk_norm_w: torch.Tensor | None, qk_eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int, scale: float,
                 w_gate: torch.Tensor | None = None, top_k: int = 0, renorm: bool = False,
                 routed_scale: float = 1.0, w_qkv_packed: packed_linear.PackedWeight | None = None,
                 w_o_packed: packed_linear.PackedWeight | None = None,
                 w_gate_packed: packed_linear.PackedWeight | None = None):
        hidden = ln1_w.shape[0]
        cpu_ops.need(heads % kv_heads == 0 and head_dim % 2 == 0 and head_dim <= 1024,
                     lambda: f"heads {heads} / kv heads {kv_heads} / head dim {head_dim} not supported")
        table = cos.shape[0]
        experts = 0 if w_gate is None else w_gate.shape[0]
        cpu_ops.need(w_gate is None or 1 <= top_k <= experts, lambda: f"top_k {top_k} must lie in [1, {experts}]")
        self.tensors = [_check(ln1_w, "ln1_w", (hidden,)), _check(ln2_w, "ln2_w", (hidden,)),
                        _check(w_qkv, "w_qkv", ((heads + 2 * kv_heads) * head_dim, hidden)),
                        _check(w_o, "w_o", (hidden, heads * head_dim)),
                        _check(cos, "cos", (table, head_dim)), _check(sin, "sin", (table, head_dim))]
        if qk_norm_w is not None:
            self.tensors.append(_check(qk_norm_w, "qk_norm_w", (heads + kv_heads, head_dim)))
        if w_gate is not None:
            self.tensors.append(_check(w_gate, "w_gate", (experts, hidden)))
        self.hidden, self.heads, self.kv_heads, self.head_dim, self.top_k = hidden, heads, kv_heads, head_dim, top_k
        self.experts = experts
        self.macs_per_row = macs_per_row(w_qkv, w_o, w_gate)
        # the kernel's GEMMs read the weights packed in panels (csrc/gemm.c): the layers' copies where given
        self.packed = [_packed(w, p) for w, p in ((w_qkv, w_qkv_packed), (w_o, w_o_packed), (w_gate, w_gate_packed))
                       if w is not None]
        gate_p = self.packed[2].data.data_ptr() if w_gate is not None else None
        self.params = AttnBlockParams(
            hidden, heads, kv_heads, head_dim, experts, top_k, int(renorm), table, norm_eps, qk_eps, scale,
            routed_scale, ln1_w.data_ptr(), self.packed[0].data.data_ptr(),
            None if qk_norm_w is None else qk_norm_w.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            self.packed[1].data.data_ptr(), ln2_w.data_ptr(), gate_p)
        self._params_ref = ctypes.byref(self.params)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor, attn: BlockAttentionInputs
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The layer's attention block for T tokens.

        Shapes: ``x`` [T, H] float32 with unit last stride (the residual stream entering the layer);
        ``positions`` and ``loc`` (the KV slots their keys and values go to) [T] int64 contiguous; ``attn`` as
        :class:`BlockAttentionInputs` (token t attends to the first ``min(max(lens[t], 1), L)`` slots of its
        slot list, its own key included).
        Returns ``(residual, hidden, topk_weights, topk_ids)``: ``residual = x + attention output`` and
        ``hidden = post-attention RMSNorm(residual)``, [T, H] float32; the router's float32 weights and int64 ids
        [T, top_k] (None without a router).
        Raises:
            ValueError: a shape, stride or dtype the kernel cannot take.
            IndexError: a position outside the rotary table, a KV slot outside ``[0, slots)`` or a token row
                outside ``[0, R)``.
        """
        t, h = x.shape
        k_buf, v_buf, kv_indices, rows = attn.k_buf, attn.v_buf, attn.kv_indices, attn.token_rows
        cpu_ops.need(h == self.hidden and x.stride(1) == 1 and x.dtype is torch.float32,
                     lambda: f"x must be [T, {self.hidden}] float32 with unit last stride")
        named = (("positions", positions), ("loc", loc), ("lens", attn.lens), ("token_rows", rows))
        for name, idx in named:
            cpu_ops.need(idx is None or (idx.shape == (t,) and idx.dtype == torch.int64 and idx.is_contiguous()),
                         lambda name=name: f"{name} must be a contiguous [T] int64 tensor")
        cpu_ops.need(k_buf.is_contiguous() and v_buf.is_contiguous() and k_buf.shape == v_buf.shape
                     and k_buf.shape[1:] == (self.kv_heads, self.head_dim) and k_buf.dtype is torch.float32,
                     "k_buf and v_buf must be contiguous [slots, Hkv, D] float32 tensors of one shape")
        cpu_ops.need(kv_indices.dim() == 2 and (rows is not None or kv_indices.shape[0] == t)
                     and kv_indices.dtype == torch.int64 and kv_indices.stride(1) == 1,
                     "kv_indices must be [R, L] int64 with unit last stride (R = T without token_rows)")
        residual = torch.empty((t, h), dtype=torch.float32)
        hidden = torch.empty((t, h), dtype=torch.float32)
        weights = ids = None
        if self.experts:
            weights = torch.empty((t, self.top_k), dtype=torch.float32)
            ids = torch.empty((t, self.top_k), dtype=torch.int64)
        rc = cpu_ops.lib().raymoe_attn_block_f32(
            self._params_ref, x.data_ptr(), x.stride(0), t, positions.data_ptr(), loc.data_ptr(), k_buf.data_ptr(),
            v_buf.data_ptr(), k_buf.shape[0], kv_indices.data_ptr(), kv_indices.stride(0), kv_indices.shape[1],
            kv_indices.shape[0], None if rows is None else rows.data_ptr(), attn.lens.data_ptr(),
            residual.data_ptr(), hidden.data_ptr(),
            None if weights is None else weights.data_ptr(), None if ids is None else ids.data_ptr())
        if rc == -1:
            raise IndexError(f"a KV slot lies outside [0, {k_buf.shape[0]})")
        if rc == -3:
            raise IndexError(f"a token row lies outside [0, {kv_indices.shape[0]})")
        if rc == -4:
            raise IndexError(f"a position lies outside the rotary table of {self.params.table_rows} rows")
        if rc != 0:
            raise MemoryError("the attention block could not allocate its scratch rows")
        return residual, hidden, weights, ids
