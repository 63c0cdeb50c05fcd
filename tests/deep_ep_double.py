"""A CPU conformance double of DeepEP v1.2.x's Python API (``deep_ep.Buffer``, ``Config``, ``EventOverlap``) over
gloo, so the DeepEP adapter (``raymoe.platform.cuda.deepep``) is tested without a GPU.

It keeps DeepEP's signatures (keyword names and defaults), return tuples, tensor layouts and dtypes (int32
counts, int64 top-k ids with -1, Python lists, the low-latency ``[E_local, M_max * ranks, H]`` layout), its
opaque handles, and its host-side checks (``EP_HOST_ASSERT`` in ``csrc/deep_ep.cpp``, buffer-size bounds from
``csrc/config.hpp``). It is stricter than the library where the library would silently corrupt data:

* results that are not yet valid (an ``async_finish`` result before ``event.current_stream_wait()``, a
  ``return_recv_hook`` result before ``hook()``) are :class:`Unreceived` tensors: any read raises, only metadata
  (shape, dtype, size, dim) is allowed; a hook called twice raises;
* the two low-latency buffers alternate per low-latency kernel; launching onto a buffer whose kernel was not
  received raises (a third result in flight), and so does a low-latency kernel after a normal one without
  ``clean_low_latency_buffer`` (DeepEP requires it);
* buffers must be symmetric (same sizes on every rank), ranks must agree on ``num_max_dispatch_tokens_per_rank``
  / hidden / experts, the layout passed to ``dispatch`` must match ``topk_idx``, the low-latency combine must get
  the ``topk_idx`` of its dispatch, and rows beyond ``recv_count`` are NaN (nobody may read them);
* the source-rank blocks of each expert's low-latency rows come in a changing order (DeepEP packs them in arrival
  order);
* the kernels' limits (``deep_ep_double_core``, with where each is in DeepEP's source): top-k <= 11 in the
  low-latency kernels and <= 32 in the intranode ones, 2, 4 or 8 intranode ranks, <= 128 local experts in the
  normal mode, contiguous layout and handle tensors (``is_token_in_rank`` included), and expert ids in
  ``[-1, E)`` (the library would read out of bounds);
* CUDA graphs (``deep_ep_double_graph``): a normal-mode dispatch cannot be captured, and a replay must make the
  library calls its capture made, on the same low-latency buffers (a GPU replay runs only the captured kernels);
* nodes: DeepEP takes ranks ``[8 r, 8 r + 8)`` as the GPUs of node ``r`` (``NUM_MAX_NVL_PEERS``) and opens their
  CUDA IPC handles when the buffer is built; ranks of one such NVLink domain on two nodes are refused there (the
  node of a rank: ``deep_ep_double_core.simulate_node``, else the host name). Above 8 ranks the internode kernels
  run (``deep_ep_double_internode``: 2 to 20 nodes of 8 ranks, its own limits and handle).

Not modelled (``NotImplementedError``): FP8 inputs, cached-handle dispatch, ``num_worst_tokens``, bias,
zero-copy/LogFMT combine, MNNVL. Dtype and hidden-size limits of the real kernels are enforced by default
(:data:`STRICT`); :data:`RELAXED` lets tests run float32 and tiny hidden sizes to compare results exactly.
The low-latency half is in ``deep_ep_double_ll``.
"""

from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from deep_ep_double_core import (
    ALIGN,
    INT_MAX,
    NUM_MAX_NVL_PEERS,
    NUM_MAX_RDMA_PEERS,
    SOURCE_META_BYTES,
    EventHandle,
    EventOverlap,
    check,
    check_expert_ids,
    misuse,
    this_node,
)
from deep_ep_double_graph import library_call
from deep_ep_double_internode import in_node
from deep_ep_double_ll import LL_HIDDEN_SIZES, LowLatencyMixin


@dataclass(frozen=True)
class Limits:
    """What the kernels accept: hidden dtypes of the combine and low-latency kernels, and low-latency hidden
    sizes (None: any multiple of 16 elements)."""

    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
    ll_hidden_sizes: tuple[int, ...] | None = LL_HIDDEN_SIZES


STRICT = Limits()
RELAXED = Limits(dtypes=(torch.bfloat16, torch.float32, torch.float64), ll_hidden_sizes=None)
BF16_ANY_H = Limits(ll_hidden_sizes=None)  # the kernels' dtype rule, tiny hidden sizes allowed


class Config:
    """``deep_ep.Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)`` with its checks and size hints."""

    def __init__(self, num_sms: int, num_max_nvl_chunked_send_tokens: int, num_max_nvl_chunked_recv_tokens: int,
                 num_max_rdma_chunked_send_tokens: int, num_max_rdma_chunked_recv_tokens: int):
        check(num_sms >= 0 and 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, "Config")
        check(num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0, "Config")
        rdma_recv = -(-num_max_rdma_chunked_recv_tokens // num_max_rdma_chunked_send_tokens) * \
            num_max_rdma_chunked_send_tokens
        check(num_max_rdma_chunked_send_tokens <= rdma_recv // 2, "Config: rdma send <= recv / 2")
        self.num_sms, self.num_max_nvl_chunked_send_tokens = num_sms, num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens = \
            num_max_rdma_chunked_send_tokens, rdma_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        check(num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0, "nvl hint: ranks")
        rdma_ranks, nvl_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1), min(num_ranks, NUM_MAX_NVL_PEERS)
        per = (self.num_sms // 2) * nvl_ranks
        recv = per * self.num_max_nvl_chunked_recv_tokens
        n = per * (2 * rdma_ranks + 3) * 4 + recv * (hidden_bytes + SOURCE_META_BYTES + 128 * 8 + 128 * 4 + 128 * 4)
        return (n + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        per = (self.num_sms // 2) * (num_ranks // NUM_MAX_NVL_PEERS)
        recv = per * self.num_max_rdma_chunked_recv_tokens
        n = per * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4 + recv * 2 * (hidden_bytes + SOURCE_META_BYTES + 128 * 8
                                                                   + 128 * 4 + 128 * 4 + 16)
        return (n + 127) // 128 * 128


# Buffer.get_dispatch_config / get_combine_config of deep_ep/buffer.py (v1.2.1)
_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
             24: (8, 288, 32, 128), 32: (32, 288, 32, 128), 64: (20, 288, 28, 128), 128: (20, 560, 32, 128),
             144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
            24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 64: (1, 288, 20, 128), 128: (1, 560, 12, 128),
            144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


class Buffer(LowLatencyMixin):
    """``deep_ep.Buffer`` over gloo. See the module docstring for what is checked."""

    num_sms: int = 20
    limits: Limits = STRICT

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, comm=None) -> None:
        if group is None:
            if comm is None:
                raise ValueError("Either 'group' or 'comm' must be provided.")
            raise NotImplementedError("the double does not model mpi4py communicators")
        self.rank, self.group, self.group_size = group.rank(), group, group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        self.num_qps_per_rank = num_qps_per_rank
        check(num_nvl_bytes % ALIGN == 0 and (num_nvl_bytes <= INT_MAX or num_rdma_bytes == 0), "num_nvl_bytes")
        check(num_rdma_bytes % ALIGN == 0 and (low_latency_mode or num_rdma_bytes <= INT_MAX), "num_rdma_bytes")
        check(self.group_size <= NUM_MAX_NVL_PEERS * NUM_MAX_RDMA_PEERS or low_latency_mode, "num_ranks")
        check(self.group_size < NUM_MAX_NVL_PEERS or self.group_size % NUM_MAX_NVL_PEERS == 0, "num_ranks")
        check(num_rdma_bytes == 0 or self.group_size > NUM_MAX_NVL_PEERS or low_latency_mode,
              "RDMA bytes need internode ranks or the low-latency mode")
        # deep_ep.cpp Buffer::Buffer: the NVLink domain of a rank is ranks [8 * rdma_rank, 8 * rdma_rank + 8)
        self.rdma_rank, self.nvl_rank = self.rank // NUM_MAX_NVL_PEERS, self.rank % NUM_MAX_NVL_PEERS
        self.num_rdma_ranks = max(1, self.group_size // NUM_MAX_NVL_PEERS)
        self.num_nvl_ranks = min(self.group_size, NUM_MAX_NVL_PEERS)
        if low_latency_mode:
            assert num_qps_per_rank > 0
        # One gather stands for the library's device-id and IPC-handle gathers (and the double's symmetry check).
        mine = (num_nvl_bytes, num_rdma_bytes, bool(low_latency_mode), this_node())
        everyone = [None] * self.group_size
        dist.all_gather_object(everyone, mine, group=group)
        check(all(e[:3] == mine[:3] for e in everyone), "buffers must be symmetric (same sizes on every rank)")
        self.rank_nodes = [e[3] for e in everyone]
        if num_nvl_bytes > 0:
            self._check_nvlink_domains()
        self.runtime = object()
        self._init_low_latency()

    def _check_nvlink_domains(self) -> None:
        """``Buffer::sync`` opens the CUDA IPC handles of the ranks of its NVLink domain; a handle made on another
        node cannot be opened there (``cudaIpcOpenMemHandle`` fails). Every rank sees the gathered nodes and
        raises, where the library would fail on the ranks of a split domain and hang the others in NVSHMEM's
        initialization."""
        n = self.num_nvl_ranks
        for d in range(self.num_rdma_ranks):
            nodes = self.rank_nodes[d * n:(d + 1) * n]
            if len(set(nodes)) > 1:
                raise misuse(f"cudaIpcOpenMemHandle fails: ranks {d * n}-{(d + 1) * n - 1} are one NVLink domain "
                             f"(DeepEP takes ranks [8 r, 8 r + 8) as the GPUs of node r, NUM_MAX_NVL_PEERS = 8) but "
                             f"sit on {len(set(nodes))} nodes: {nodes}")

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        check(self.runtime is not None, "not destroyed")
        self.runtime = None

    @staticmethod
    def is_sm90_compiled() -> bool:
        return False

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> Config:
        assert num_ranks in _DISPATCH, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(cls.num_sms, *_DISPATCH[num_ranks])

    @classmethod
    def get_combine_config(cls, num_ranks: int) -> Config:
        assert num_ranks in _COMBINE, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(cls.num_sms, *_COMBINE[num_ranks])

    def _stream_args(self, previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> None:
        check(self.runtime is not None, "buffer destroyed")
        if allocate_on_comm_stream:
            check(getattr(previous_event, "event", None) is not None and async_finish,
                  "allocate_on_comm_stream needs previous_event and async_finish")

    def _event(self, async_finish: bool, works=(), on_wait=None) -> EventOverlap:
        """The call's event; without ``async_finish`` the data is waited for and delivered now."""
        handle = EventHandle(works, on_wait)
        if async_finish:
            return EventOverlap(handle)
        handle.current_stream_wait()
        return EventOverlap(None)

    @library_call("get_dispatch_layout")
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank [ranks] int32, num_tokens_per_rdma_rank [ranks / 8] int32 (None within a node),
        num_tokens_per_expert [E] int32, is_token_in_rank [N, ranks] bool, EventOverlap)."""
        self._stream_args(previous_event, async_finish, allocate_on_comm_stream)
        check(topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == torch.int64, "topk_idx")
        check(num_experts > 0 and num_experts % self.group_size == 0, "num_experts")
        check_expert_ids(topk_idx, num_experts)
        per_expert, in_rank = _layout(topk_idx, num_experts, self.group_size)
        per_rank = in_rank.sum(0, dtype=torch.int32)
        per_rdma_rank = None
        if self.group_size > NUM_MAX_NVL_PEERS:
            per_rdma_rank = in_node(in_rank).sum(0, dtype=torch.int32)
        return per_rank, per_rdma_rank, per_expert, in_rank, self._event(async_finish)

    # The normal-mode dispatch and combine live in deep_ep_double_normal (NormalModeMixin) to keep files small.


def _layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens per expert [E] int32 and token-in-rank [N, ranks] bool of ``topk_idx`` (-1 selects nothing)."""
    valid = topk_idx >= 0
    ids = topk_idx[valid]
    per_expert = torch.bincount(ids, minlength=num_experts).to(torch.int32)
    in_rank = torch.zeros(topk_idx.shape[0], num_ranks, dtype=torch.bool)
    rows = valid.nonzero(as_tuple=True)[0]
    in_rank[rows, ids // (num_experts // num_ranks)] = True
    return per_expert, in_rank


@functools.cache
def buffer_class(limits: Limits = STRICT) -> type:
    """The double's ``Buffer`` enforcing ``limits`` (one class per limits, so layers share it)."""
    from deep_ep_double_internode import InternodeMixin
    from deep_ep_double_normal import NormalModeMixin

    return type("Buffer", (NormalModeMixin, InternodeMixin, Buffer), {"limits": limits})


def install(limits: Limits = STRICT) -> types.ModuleType:
    """Put a ``deep_ep`` module backed by this double in ``sys.modules`` (for this process) and return it."""
    module = types.ModuleType("deep_ep")
    module.Buffer, module.Config, module.EventOverlap = buffer_class(limits), Config, EventOverlap
    module.__version__ = "1.2.1+cpu-double"
    sys.modules["deep_ep"] = module
    return module
