"""The CPU platform's ``torch_native`` MLA backend: weight-absorbed decode through the fused paged-attention kernel
(``raymoe.platform.cpu.kernels.cpu_ops.decode_attention``) instead of a gather and SDPA (or the chunked online
softmax) per layer.

Absorbed MLA decode (DeepSeek-V2, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language
Model", 2024) is multi-query attention over the latent cache: every query head scores the same cached rows
``[c_kv | k_pe]`` (``Dc = kv_lora_rank + qk_rope_head_dim`` floats) and sums their latent part ``c_kv``. The kernel
takes it as grouped-query attention with one KV head of ``Dc`` and the cache as both keys and values; its output's
first ``kv_lora_rank`` columns are the attention output (the last ``qk_rope_head_dim`` sum the rope part and are
dropped: 20 % more accumulation for DeepSeek-V3's 512 + 64, no gather). It reads the slots in place through
``kv_indices``, so a row costs its own length whatever the step's widest row, and a verify step's tokens (decode rows
here, ``verify_as_decode``) each read their request's rows once. Measured on the CI machine, one 16-layer trained
DeepSeek demo stream with a 200-token context: a decode step 9.9 -> 7.9 ms. Up to :data:`KERNEL_MAX_ROWS` rows.

Each row's attended length is its mask's count (``kv_mask`` marks positions below the row's length, in eager steps
and graph replays alike), so the kernel sees what the reference path masks. Without the kernels (another dtype,
``RAYMOE_CPU_KERNELS=0``) the reference path runs.
"""

from __future__ import annotations

import torch

from raymoe.attention.mla_torch_native import TorchNativeMLABackend
from raymoe.platform.cpu.kernels import cpu_ops

KERNEL_MAX_ROWS = 8
"""Most decode rows (a verify step's tokens count one each) the kernel takes; larger steps keep the reference path.
The kernel runs on one thread, SDPA's GEMMs on the rank's intra-op threads: a 16-layer DeepSeek demo on the CI
machine (one rank, 2 threads) decoded 14 % faster by the kernel at batch 1 and 8 % slower at batch 32 (py-spy: the
kernel's share of a batch-32 step 1.5x the gather + SDPA's); about even at 8."""


class CpuMLABackend(TorchNativeMLABackend):
    """``TorchNativeMLABackend`` with the fused decode kernel (module docstring); same arguments as its base."""

    def attend_decode(self, q: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """Absorbed decode attention. Args: ``q`` [bs, H, Dc] float absorbed queries; ``buf`` the layer's cache
        [slots, Dc]. Returns [bs, H, kv_lora_rank] (a view of the kernel's [bs, H, Dc] output)."""
        if not cpu_ops.enabled_for(q, buf) or not 0 < q.shape[0] <= KERNEL_MAX_ROWS:
            return super().attend_decode(q, buf)
        lens = self.kv_mask.view(q.shape[0], -1).sum(dim=1)  # [bs] int64: positions visible to each row
        rows = buf.view(buf.shape[0], 1, buf.shape[1])
        out = cpu_ops.decode_attention(q.contiguous(), rows, rows, self.kv_indices, lens, self.scale)
        return out[..., : self.kv_lora_rank]
