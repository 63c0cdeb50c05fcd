"""GraphRunner: capture decode forwards per batch-size bucket (and, on CUDA, per KV width), replay them with
padded static inputs.

Ownership: one per ``ModelRunner`` (rank side). The driver picks the bucket of a step for all ranks
(``raymoe.runner.graph_buckets.plan_graph_bs``, shipped as ``ModelWorkerBatch.graph_bs``); the runner asks
:meth:`GraphRunner.can_run` and then calls :meth:`GraphRunner.replay`, else runs eagerly.

Capture (largest bucket first): point the attention backend's metadata at its graph buffers
(``init_forward_metadata_capture_cuda_graph``), then

* on CUDA: warm-up runs on a side stream, then ``torch.cuda.CUDAGraph`` capture into one memory pool shared
  by every graph (the largest graph sizes the pool, the smaller ones reuse it). Every graph copies its logits
  into one shared output buffer [max_bs, V] float32, so the graphs kept alive hold no per-graph output;
* on CPU: record a callable over the bucket's static ``ForwardBatch`` (optionally ``torch.compile``-d) and run
  it once. It reads only the static buffers and the backend's graph buffers, exactly what a CUDA graph would
  read, so buffer, padding and metadata bugs show up in CPU tests. With the low-latency MoE dispatch that run is
  made under ``HostSyncGuard``, which raises on any host sync or data-dependent shape a CUDA graph could not hold.

Replay: copy the real rows into the static buffers and pad the rest (``GraphInputBuffers.populate``), refresh
the attention metadata in place (``init_forward_metadata_replay_cuda_graph``), replay, and return the first
``batch_size`` rows of the output. Graphs are keyed by ``(bucket, use_tbo)``: with two-batch overlap a bucket is
captured with the split of its padded size (children are views of the static buffers, each child refreshes its
own attention backend's graph buffers), so replay needs the same TBO decision as capture.

KV widths: a CUDA graph's shapes are frozen, so a graph attends over a fixed number of key positions per row. On
CUDA, with a backend whose decode cost follows that width (``supports_graph_kv_widths``), each (bucket, use_tbo)
is captured at every width of ``graph_buckets.kv_width_ladder`` (tokens, up to the table width) and a replay picks
the smallest width that holds the step's longest sequence (``graph_buckets.select_kv_width`` over the host copy
of the padded sequence lengths: no host sync). The width changes only attention over the rank's own rows, no
collective, so it is chosen on each rank alone (no driver decision). Graphs are keyed by
``(bucket, use_tbo, kv_width)``. On CPU a replay is a Python callable, so by default each (bucket, use_tbo) is
recorded once at the table width and the backend narrows every replay to the step's longest sequence;
``kv_widths=`` forces the CUDA scheme on CPU (tests cover that path without a GPU).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from raymoe.platform.interface import GraphCapture, GraphOutput, GraphStep
from raymoe.runner.forward_batch import ForwardBatch
from raymoe.runner.graph_buckets import select_graph_bs, select_kv_width
from raymoe.runner.graph_buffers import GraphInputBuffers
from raymoe.step.forward_mode import ForwardMode

logger = logging.getLogger(__name__)

ForwardFn = Callable[[ForwardBatch], GraphOutput]


class GraphRunner:
    """Decode graphs of one rank.

    Args:
        forward_fn: ``fb -> logits`` [bs, V] float32 of every row (the runner's eager forward), or a tuple of
            outputs with a row per batch row each (logits and the final hidden states [bs, H] where a draft model
            reads them; a draft model's pass, ``raymoe.runner.mtp_drafter``); it must read the batch only through
            its tensors, the attention backend and buffers of fixed address.
        attn_backend: the backend the forward uses; must implement the graph hooks of ``AttentionBackend``.
        sizes: bucket sizes to capture (any order; ``graph_buckets.capture_sizes``).
        capture: the platform's capturer on the rank's device (``Platform.graph_capture``: CUDA graphs, or
            recordings of the eager forward).
        max_kv_len: longest sequence a graph attends over, tokens (the ReqToTokenPool row width).
        kv_widths: KV widths to capture each (bucket, use_tbo) at, tokens (``max_kv_len`` is always added; none
            may exceed it; only ``max_kv_len`` when the backend does not ``supports_graph_kv_widths``). ``None``:
            ``[max_kv_len]`` where the capture fixes widths (the model runner passes ``RunnerConfig.graph_kv_widths``),
            else one recording per (bucket, use_tbo) that narrows dynamically on replay. Given explicitly, the
            fixed-width scheme runs on recordings too.
        tbo_modes: which ``use_tbo`` values to capture per bucket (``(False,)``: TBO steps run eagerly). TBO
            is captured for buckets of 2 rows or more (a decode split at ``bs // 2`` needs both halves).
        tbo_prepare: ``fb -> None`` attaching ``fb.tbo_children`` (each with its own attention backend) to a
            static batch; required when ``tbo_modes`` contains True.
        use_compile: run each bucket's forward through ``torch.compile`` (static shapes per bucket).
        low_latency: capture the low-latency MoE dispatch (``ForwardBatch.dispatch_capacity`` = the bucket size,
            as the driver plans decode steps, ``raymoe.comm.a2a_plan``), which must be free of host syncs; False:
            normal mode (recordings only: its shapes depend on the routing, so a CUDA graph cannot hold it).
        show_progress: show a tqdm bar while capturing.
        before_replay: called on the host before each replay, outside the graph: a replay runs only the captured
            kernels, so host-side state a captured forward relies on is restored here (the DeepEP dispatcher's
            low-latency mode, ``DeepEPDispatcher.prepare_graph_replay``).
        init_backend_state: allocate the attention backend's graph buffers (``init_cuda_graph_state``); False where
            another runner's graphs share the backend and did it already (a draft model's graphs: both sets of
            graphs read the same buffers, each replay refreshes them).
    Raises:
        NotImplementedError: the attention backend cannot be captured.
        ValueError: ``sizes`` is empty or has a size below 1, a KV width outside ``[1, max_kv_len]``, or TBO
            capture without ``tbo_prepare``.
    """

    def __init__(self, forward_fn: ForwardFn, attn_backend, sizes: Sequence[int], capture: GraphCapture,
                 device: torch.device | str, max_kv_len: int, tbo_modes: Sequence[bool] = (False,),
                 tbo_prepare: Callable[[ForwardBatch], None] | None = None, use_compile: bool = False,
                 low_latency: bool = False, show_progress: bool = True, kv_widths: Sequence[int] | None = None,
                 before_replay: Callable[[], None] | None = None, init_backend_state: bool = True):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"graph batch sizes must be a non-empty list of sizes >= 1, got {list(sizes)}")
        if True in tbo_modes and tbo_prepare is None:
            raise ValueError("capturing TBO graphs needs tbo_prepare")
        self.sizes = sorted(set(sizes))
        self.max_bs = self.sizes[-1]
        self.device = torch.device(device)
        self.capturer = capture
        self.attn_backend = attn_backend
        self.tbo_modes = tuple(dict.fromkeys(tbo_modes))
        self.tbo_prepare = tbo_prepare
        self.max_kv_len = max_kv_len
        self.fixed_width = kv_widths is not None or capture.fixed_kv_width  # False: narrowed per replay
        kv_widths = [max_kv_len] if kv_widths is None else list(kv_widths)
        if any(not 1 <= w <= max_kv_len for w in kv_widths):
            raise ValueError(f"graph KV widths must lie in [1, {max_kv_len}] tokens, got {kv_widths}")
        if not getattr(attn_backend, "supports_graph_kv_widths", False):  # its kernels ignore the width
            kv_widths = [max_kv_len]
        self.kv_widths = sorted(set(kv_widths) | {max_kv_len})
        self.replayed_widths: dict[int, int] = dict.fromkeys(self.kv_widths, 0)  # replays per KV width
        self.use_compile = use_compile
        self.low_latency = low_latency
        self.before_replay = before_replay
        self.forward_fn = torch.compile(forward_fn, dynamic=False) if use_compile else forward_fn
        if init_backend_state:
            attn_backend.init_cuda_graph_state(self.max_bs, max_kv_len)
        self._backends_with_state = {id(attn_backend)}
        self.buffers = GraphInputBuffers.create(self.max_bs, self.device,
                                                attn_backend.get_cuda_graph_seq_len_fill_value())
        self.static_batches: dict[tuple[int, bool], ForwardBatch] = {}  # shared by the widths of a bucket
        self.graphs: dict[tuple[int, bool, int], GraphStep] = {}  # (bs, use_tbo, kv_width)
        self.capture_seconds = 0.0
        self.capture(show_progress)

    def capture(self, show_progress: bool = True) -> None:
        """Capture every (bucket, use_tbo, kv_width), largest first, and log the count, sizes and time taken."""
        keys = [(bs, tbo, w) for bs in reversed(self.sizes) for tbo in self.tbo_modes if bs >= 2 or not tbo
                for w in reversed(self.kv_widths)]
        t0 = time.perf_counter()
        with self._compile_limits(len(keys)):
            for bs, tbo, w in tqdm(keys, desc="capture decode graphs", unit="graph", disable=not show_progress):
                self.graphs[(bs, tbo, w)] = self._capture_one(bs, tbo, w)
        self.capturer.finish()
        self.capture_seconds = time.perf_counter() - t0
        widths = self.kv_widths if self.fixed_width else f"dynamic up to {self.max_kv_len}"
        logger.info("captured %d decode graphs on %s (batch sizes %s, tbo %s, KV widths %s tokens%s) in %.2f s",
                    len(keys), self.device, self.sizes, list(self.tbo_modes), widths,
                    ", torch.compile" if self.use_compile else "", self.capture_seconds)

    def _compile_limits(self, num_graphs: int):
        """Let torch.compile keep one specialization per bucket (its default limit is 8 per function)."""
        if not self.use_compile:
            return contextlib.nullcontext()
        limit = num_graphs + 8
        return torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=max(256, 8 * limit))

    def _static_batch(self, bs: int, use_tbo: bool) -> ForwardBatch:
        """The static batch of (bs, use_tbo), built on first use (with its TBO split and children's state)."""
        if (bs, use_tbo) in self.static_batches:
            return self.static_batches[(bs, use_tbo)]
        fb = self.buffers.forward_batch(bs, self.attn_backend, use_tbo)
        fb.dispatch_capacity = bs if self.low_latency else None
        self.static_batches[(bs, use_tbo)] = fb
        if use_tbo:
            self.tbo_prepare(fb)
            for child in fb.tbo_children:
                if id(child.attn_backend) not in self._backends_with_state:
                    child.attn_backend.init_cuda_graph_state(self.max_bs, self.max_kv_len)
                    self._backends_with_state.add(id(child.attn_backend))
        return fb

    def _capture_one(self, bs: int, use_tbo: bool, kv_width: int) -> GraphStep:
        fb = self._static_batch(bs, use_tbo)
        self.buffers.pad(0, bs)
        width = kv_width if self.fixed_width else None
        for part in fb.tbo_children or [fb]:
            part.attn_backend.init_forward_metadata_capture_cuda_graph(part.batch_size, part.req_pool_indices,
                                                                       part.seq_lens, ForwardMode.DECODE,
                                                                       kv_width=width)
        forward_fn = self.forward_fn

        def run() -> GraphOutput:
            return forward_fn(fb)

        # the low-latency dispatch must be free of host syncs, as a CUDA graph needs (a recording proves it)
        return self.capturer.capture(run, bs, self.max_bs, self.low_latency and not self.use_compile)

    def bucket_for(self, forward_batch: ForwardBatch) -> int | None:
        """The bucket ``forward_batch`` replays: its ``graph_bs`` when set (must be a captured size that holds
        the batch), else the smallest captured size that holds it; ``None`` when there is none. An IDLE
        batch has a bucket only when the driver gave it one. Accepts a ``ModelWorkerBatch`` too."""
        fb = forward_batch
        if fb.graph_bs is not None:
            return fb.graph_bs if fb.graph_bs in self.sizes and fb.batch_size <= fb.graph_bs else None
        if fb.forward_mode.is_idle():
            return None
        return select_graph_bs(fb.batch_size, self.sizes)

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """Whether ``forward_batch`` can replay a graph: DECODE (or IDLE with a driver-chosen bucket), one
        token per row, a captured bucket that holds it, and a capture with the same TBO decision. Accepts a
        ``ModelWorkerBatch`` too (the same fields), so the runner can decide before building tensors.

        Every input to this decision except the row count is shared by all ranks of the step (mode family,
        ``graph_bs``, ``use_tbo``), so ranks given the same ``graph_bs`` agree.
        """
        fb = forward_batch
        if not fb.forward_mode.is_decode_or_idle() or fb.num_tokens != fb.batch_size:
            return False
        bs = self.bucket_for(fb)
        return bs is not None and (bs, fb.use_tbo) in self.static_batches

    def kv_width_for(self, seq_lens_cpu: Sequence[int]) -> int:
        """The captured KV width (tokens) a step with these host sequence lengths (padding rows included) replays:
        the smallest that holds the longest (on CPU without fixed widths: the one recording, ``max_kv_len``).

        Raises:
            ValueError: a sequence is longer than ``max_kv_len`` (it could not be in the table either).
        """
        longest = max(seq_lens_cpu, default=1)
        width = select_kv_width(longest, self.kv_widths)
        if width is None:
            raise ValueError(f"sequence of {longest} tokens is longer than the graphs' {self.max_kv_len}")
        return width if self.fixed_width else self.max_kv_len

    @torch.no_grad()
    def replay(self, forward_batch: ForwardBatch) -> GraphOutput:
        """Run ``forward_batch`` through the graph of its bucket, TBO decision and KV width (:meth:`kv_width_for`,
        chosen on this rank from host values; counted in ``replayed_widths``).

        Returns:
            float32 logits [batch_size, V], or the forward's tuple with each output cut to ``batch_size`` rows (on
            CUDA views of the graphs' shared outputs, valid until the next replay).
        Raises:
            ValueError: :meth:`can_run` is false for this batch, or a sequence is longer than ``max_kv_len``.
        """
        fb = forward_batch
        if not self.can_run(fb):
            raise ValueError(f"no captured graph for a {fb.forward_mode.name} batch of {fb.batch_size} rows "
                             f"(graph_bs={fb.graph_bs}, use_tbo={fb.use_tbo}); check can_run first")
        bs = self.bucket_for(fb)
        static = self.static_batches[(bs, fb.use_tbo)]
        seq_lens_cpu = self.buffers.populate(fb, bs)
        width = self.kv_width_for(seq_lens_cpu)
        for part in static.tbo_children or [static]:
            r0, r1 = part.tbo_parent_token_range or (0, bs)  # decode: one token per row
            part.attn_backend.init_forward_metadata_replay_cuda_graph(
                part.batch_size, part.req_pool_indices, part.seq_lens, seq_lens_cpu[r0:r1], ForwardMode.DECODE,
                kv_width=width if self.fixed_width else None)
        if self.before_replay is not None:
            self.before_replay()
        out = self.graphs[(bs, fb.use_tbo, width)].replay()
        self.replayed_widths[width] += 1
        n = fb.batch_size
        return tuple(o[:n] for o in out) if isinstance(out, tuple) else out[:n]
