"""ModelRunner: one rank's model shard, KV pools, attention backend and sampler.

Ownership: the runner is the only code that touches model tensors. It takes the driver's plain-data
``ModelWorkerBatch``, writes the request -> slot table, builds the ``ForwardBatch``, runs the model (eager or a
captured graph) and samples, answering with a ``StepOutput``. A step is launched without any host sync
(:meth:`ModelRunner.launch_step`) and answered once its tokens reached the host (``raymoe.runner.step_result``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from raymoe.attention.tbo import TboAttnBackend
from raymoe.comm.dispatcher import A2ABackendSpec
from raymoe.comm.expert_input import resolve_a2a_mode
from raymoe.comm.groups import ParallelGroups
from raymoe.comm.latency import inject_a2a_latency
from raymoe.config import ModelConfig
from raymoe.eplb.rank_state import RankEplb
from raymoe.kvcache.pools import ReqToTokenPool
from raymoe.models.loader import CheckpointReader
from raymoe.models.registry import get_model_class
from raymoe.overlap.split import TboForwardBatchPreparer
from raymoe.overlap.strategy import resolve_decode_schedule
from raymoe.platform.interface import Platform
from raymoe.platform.selector import select_platform
from raymoe.runner.forward_batch import ForwardBatch
from raymoe.runner.future_tokens import FutureTokenMap
from raymoe.runner.grammar import RankGrammars
from raymoe.runner.grammar_compiler import compiler_for_model
from raymoe.runner.penalties import RankPenalties
from raymoe.runner.prompt_logprobs import logits_and_scores
from raymoe.runner.runner_config import DTYPES, RunnerConfig
from raymoe.runner.sampler import Sampler
from raymoe.runner.step_result import PendingStep
from raymoe.runner.token_rows import token_rows
from raymoe.runner.verify_step import finish_verify_step
from raymoe.runner.weight_reload import open_weights
from raymoe.step.host_transfer import to_device
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.sampling_table import SamplingTable
from raymoe.step.step_output import StepOutput
from raymoe.step.worker_batch import ModelWorkerBatch

log = logging.getLogger(__name__)


class ModelRunner:
    """Loads the rank's shard and runs steps.

    Args:
        cfg: the rank's settings. groups: its process groups (None: one rank).
        ops: the rank's platform, when its caller already chose it (the rank worker, which made the groups'
            transport with it); None: chosen here from ``cfg.device`` and ``cfg.dtype``
            (``raymoe.platform.selector.select_platform``).
        capture_graphs: capture the decode graphs now (False: the caller does it later with
            ``graph_runner = build_graph_runner()``, so a rank's start reports loading and capturing apart).
    Raises:
        CheckpointError: the model folder is missing, truncated or does not match the architecture.
    """

    def __init__(self, cfg: RunnerConfig, groups: ParallelGroups | None = None, ops: Platform | None = None,
                 capture_graphs: bool = True):
        self.cfg = cfg
        self.groups = groups or ParallelGroups.single()
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.ops = ops if ops is not None else select_platform(self.device, self.dtype)
        self.ops.tune_rank_memory()
        self.model_config = ModelConfig.from_hf(cfg.model_path)
        with CheckpointReader(cfg.model_path) as reader:
            model_cls = get_model_class(self.model_config.model_type)
            with torch.device(self.device):
                a2a = A2ABackendSpec(cfg.moe_comm.a2a_backend, cfg.moe_comm.a2a_mode, cfg.max_dispatch_tokens_per_rank)
                extra = {"expert_location": cfg.expert_location} if cfg.expert_location is not None else {}
                algo = cfg.speculative.speculative_algorithm
                if algo == "nextn":
                    extra["enable_mtp"] = True
                if cfg.swa_kv_eviction:  # rings with room for a verify step's drafts
                    extra["swa_kv_eviction"] = True
                    extra["swa_ring_slack"] = cfg.speculative.tokens_per_request - 1
                self.model = model_cls(self.model_config, self.groups, self.dtype, self.ops, a2a,
                                       enable_sbo=cfg.overlap.enable_sbo, **extra)
            self.model.load_weights(reader)
        if cfg.weight_tensors is not None:  # rebuilt after a fault: the weights of the last update from tensors
            with open_weights(cfg.model_path, cfg.weight_tensors) as reader:
                self.model.load_weights(reader)
        draft = self._draft_model() if algo in ("nextn", "eagle") else None
        self.model.eval()
        self.eplb = RankEplb.attach(self.model, cfg.eplb, cfg.expert_location, self.groups, self.device)
        self.model.tbo_decode_schedule = resolve_decode_schedule(cfg.overlap.tbo_decode_schedule,
                                                                 self.ops.default_tbo_decode_schedule)
        if cfg.inject_a2a_latency_ms > 0:
            inject_a2a_latency(self.model, cfg.inject_a2a_latency_ms)
        self.req_to_token_pool = ReqToTokenPool(cfg.max_req_rows, cfg.max_context_len, self.device, cfg.page_size)
        # The model knows its cache layout (per-head K/V, or the MLA latent) and the backend that reads it.
        self.token_to_kv_pool = self.model.create_kv_pool(cfg.num_kv_slots, self.dtype, self.device)
        # per ReqToTokenPool row: hybrid models' linear-attention states, or gpt-oss's sliding-window rings
        # (swa_kv_eviction)
        create_states = getattr(self.model, "create_state_pool", None)
        self.state_pool = create_states(cfg.max_req_rows, self.device) if create_states is not None else None
        if self.state_pool is not None:
            log.info("%s: %d request rows x %d layers = %.1f MiB", type(self.state_pool).__name__,
                     self.state_pool.rows, self.state_pool.num_layers, self.state_pool.nbytes() / 2**20)

        def make_backend():
            return self.model.create_attn_backend(cfg.attention_backend, self.req_to_token_pool,
                                                  self.token_to_kv_pool)

        self.attn_backend = TboAttnBackend.create(make_backend) if cfg.overlap.enable_tbo else make_backend()
        self.sampler = Sampler(self.ops, cfg.seed, self.device)
        self.sampling_table = SamplingTable()  # each request's sampling numbers, sent once per admission
        self.penalties = RankPenalties(cfg.max_req_rows, self.model_config.vocab_size, self.device, self.ops)
        mc = self.model_config
        self.grammars = RankGrammars(
            lambda: compiler_for_model(cfg.model_path, mc.vocab_size, tuple(mc.eos_token_ids)), self.device)
        self.future_tokens = FutureTokenMap(cfg.max_req_rows, self.device)
        self.drafter = None
        self.kv_streamer = None  # PD prefill: set with the rank's KV agent (raymoe.actors.rank_kv_transfer)
        self.verify_graph_steps = 0  # verify steps replayed as decode rows (raymoe.runner.token_rows)
        self._kv_stream = None  # the step's layer-by-layer writer, between launch_step and its end
        if draft is not None:
            from raymoe.runner.mtp_drafter import MtpDrafter

            self.drafter = MtpDrafter(draft, self.attn_backend, self.req_to_token_pool,
                                      cfg.speculative.speculative_num_steps, self.ops, self.device)
        self.graph_runner = self.build_graph_runner() if cfg.graph_capture_sizes and capture_graphs else None

    def _draft_model(self):
        """The speculative draft model the ranks run (``raymoe.runner.mtp_drafter``): DeepSeek's MTP layer built with
        the model (``nextn``), or an EAGLE head loaded from ``speculative_draft_model_path`` (``eagle``), its KV in
        one more cache layer of the model's pool."""
        if self.cfg.speculative.speculative_algorithm == "nextn":
            return self.model.mtp
        from raymoe.config.speculative import read_head_config
        from raymoe.models.eagle_head import EagleHead

        path = self.cfg.speculative.speculative_draft_model_path
        with torch.device(self.device):
            head = EagleHead(self.model_config, int(read_head_config(path)["intermediate_size"]), self.groups,
                             self.dtype, self.ops, self.model.embed_tokens, self.model.lm_head)
        with CheckpointReader(path) as reader:
            head.load(reader)
        head.eval()
        self.model.extra_kv_layers = 1
        return head

    def weight_bytes(self) -> int:
        """Bytes of this rank's resident model weights: every parameter and persistent buffer once (an FP8
        weight at one byte per element, its float32 scales included). What a platform prepared beside them (the
        CPU platform's packed float32 panels, float32 models only) is not counted."""
        seen: set[int] = set()
        total = 0
        for t in self.model.state_dict().values():
            if t.device.type != "meta" and t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return total

    def build_graph_runner(self, kv_widths: Sequence[int] | None = None):
        """Capture the decode graphs of ``cfg.graph_capture_sizes`` (a ``GraphRunner``), and the draft model's
        (``MtpDrafter.capture_graphs``) where one drafts: the target's graphs then also return the final hidden
        states [bs, H] the draft model reads.

        Args:
            kv_widths: KV widths to capture, tokens. ``None``: ``cfg.graph_kv_widths`` where the platform's graphs
                fix their width (CUDA; the graph runner keeps only the table width for a backend whose kernels
                ignore it), else one recording per bucket, narrowed on replay. Explicit widths force fixed-width
                graphs, on CPU too (tests).
        """
        from raymoe.runner.graph_runner import GraphRunner

        cfg = self.cfg

        def tbo_prepare(fb: ForwardBatch) -> None:  # TBO buckets: the split of the padded batch
            TboForwardBatchPreparer.prepare(fb, cfg.overlap.tbo_token_distribution_threshold,
                                            self.attn_backend.children)

        capture = self.ops.graph_capture(self.device)
        if kv_widths is None and capture.fixed_kv_width:
            kv_widths = cfg.graph_kv_widths
        tbo = cfg.overlap.enable_tbo
        low_latency = resolve_a2a_mode(cfg.moe_comm.a2a_mode, True) == "low_latency"
        before_replay = self._graph_replay_preparation() if low_latency else None
        target = GraphRunner(self.forward_with_hidden if self.drafter is not None else self.forward,
                             self.attn_backend, cfg.graph_capture_sizes, capture, self.device,
                             max_kv_len=cfg.max_context_len, tbo_modes=(False, True) if tbo else (False,),
                             tbo_prepare=tbo_prepare if tbo else None, use_compile=cfg.graph.enable_torch_compile,
                             low_latency=low_latency, show_progress=self.groups.world_rank == 0, kv_widths=kv_widths,
                             before_replay=before_replay)
        if self.drafter is not None:
            def draft_runner(forward_fn) -> GraphRunner:
                return GraphRunner(forward_fn, self.attn_backend, cfg.graph_capture_sizes,
                                   self.ops.graph_capture(self.device), self.device, max_kv_len=cfg.max_context_len,
                                   low_latency=low_latency, show_progress=False, kv_widths=target.kv_widths
                                   if target.fixed_width else None, before_replay=before_replay,
                                   init_backend_state=False)

            self.drafter.capture_graphs(draft_runner, self.model_config.hidden_size, self.dtype, target.max_bs)
        return target

    def _graph_replay_preparation(self):
        """A call that readies every MoE dispatcher with host-side state for a replay of a low-latency graph
        (``prepare_graph_replay``, e.g. DeepEP's mode switch), or None when no dispatcher has any."""
        hooks = {id(m.a2a): m.a2a.prepare_graph_replay for m in self.model.modules()
                 if hasattr(getattr(m, "a2a", None), "prepare_graph_replay")}
        if not hooks:
            return None

        def prepare() -> None:
            for hook in hooks.values():
                hook()

        return prepare

    def prepare(self, batch: ModelWorkerBatch, for_graph: bool = False) -> ForwardBatch:
        """Write the slot table for ``batch`` and build its ForwardBatch with attention metadata and TBO children.
        ``for_graph``: only the table and tensors (a graph replay has its own metadata and its own TBO split of
        the padded batch)."""
        fb = ForwardBatch.from_worker_batch(batch, self.device, self.sampling_table.resolve(batch))
        if batch.sampling_rows:
            self.penalties.admit(batch.sampling_rows, batch.req_pool_indices)
        if batch.input_ids and min(batch.input_ids) < 0:  # overlap scheduling: tokens of the previous step
            fb.input_ids = self.future_tokens.resolve(fb.input_ids)
        if batch.forward_mode.is_extend():
            prefix_slots = to_device(batch.prefix_slots, torch.int64, self.device)
            self.req_to_token_pool.write_extend(batch.req_pool_indices, batch.prefix_lens, batch.seq_lens,
                                                prefix_slots, fb.out_cache_loc, batch.table_lens)
        elif batch.forward_mode.is_decode():
            self.req_to_token_pool.write_decode(fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc)
        fb.attn_backend = self.attn_backend
        if for_graph:
            return fb
        if fb.use_tbo:  # two children with their own attention backends (raymoe.overlap.split)
            if not isinstance(self.attn_backend, TboAttnBackend):
                raise ValueError("batch.use_tbo is set but this rank was built without overlap.enable_tbo")
            TboForwardBatchPreparer.prepare(fb, self.cfg.overlap.tbo_token_distribution_threshold,
                                            self.attn_backend.children)
        stream = self._kv_stream
        if stream is not None:  # PD prefill: the layers' marks write the step's prompt rows as they pass
            fb.kv_stream = stream
            stream.children = len(fb.tbo_children) if fb.tbo_children else 1
            for child in fb.tbo_children or ():
                child.kv_stream = stream
        self.attn_backend.init_forward_metadata(fb)
        return fb

    @torch.no_grad()
    def forward_with_hidden(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode forward that also returns what a draft model reads: float32 logits [bs, V] and the final
        hidden states [bs, H] (one token per row)."""
        hidden = self.model(fb)
        return self.model.compute_logits(hidden[fb.sample_indices], fb.dispatch_capacity), hidden

    @torch.no_grad()
    def forward(self, fb: ForwardBatch, return_all_logits: bool = False) -> torch.Tensor:
        """Run the model. Returns float32 logits [bs, V] of each request's last token this step
        (``return_all_logits``: [T, V] for every token)."""
        hidden = self.model(fb)
        if not return_all_logits:
            hidden = hidden[fb.sample_indices]
        # the decode dispatch capacity bounds every rank's rows alike (a DP-split LM head needs a shared bound)
        return self.model.compute_logits(hidden, fb.dispatch_capacity)

    @torch.inference_mode()
    def apply_expert_update(self, update) -> None:
        """The step's expert load balancing work (``raymoe.eplb.rank_state.RankEplb``) first thing in a step (its
        commit, then its transfers), so a step that fails later still leaves every rank with the same expert
        placement and every transfer posted on every rank.

        Raises:
            ValueError: an update with work reached a rank built without an expert location.
        """
        if self.eplb is not None:
            self.eplb.before_step(update)
        elif update is not None and not update.empty:
            raise ValueError("an expert-load update reached a rank built without an expert location")

    def launch_step(self, batch: ModelWorkerBatch) -> PendingStep:
        """One step (:meth:`_launch_step`). A PD prefill step with streamed requests (``batch.kv_streams``, on a
        rank whose KV agent writes one-sided) writes their prompt rows layer by layer during the forward and
        returns once they have landed (``raymoe.kvcache.kv_stream``): also when the step raises, so no write of it
        lands later."""
        if not batch.kv_streams or self.kv_streamer is None:
            return self._launch_step(batch)
        self._kv_stream = self.kv_streamer.begin(batch.kv_streams, self.groups.tp_rank)
        try:
            return self._launch_step(batch)
        finally:
            stream, self._kv_stream = self._kv_stream, None
            stream.finish()

    @torch.inference_mode()
    def _launch_step(self, batch: ModelWorkerBatch) -> PendingStep:
        """One step up to its tokens' copy to the host: prepare, forward, sample, keep the ids for the next step's
        placeholders and start the copy; returns without waiting for the device (no host sync: a decode step is
        proven free of them on CPU, ``tests/test_decode_host_sync.py``). An IDLE batch runs the layers on zero
        tokens (so collectives match) and answers with no tokens. With ``batch.graph_bs`` set and a matching
        capture, the forward is a graph replay of that bucket (an IDLE batch then replays it with padding rows
        only; a verify step replays it as decode rows, one per token, ``raymoe.runner.token_rows``, where the model
        keeps no recurrent state).

        Runs under ``torch.inference_mode`` (no version counters or view tracking: about 5-8 % less CPU per
        decode step than ``no_grad`` on the CI machine). Tensors a step creates and keeps (gather buffers) are
        only ever written by later steps, inside the same mode."""
        t0 = time.perf_counter()
        update = batch.expert_update
        self.apply_expert_update(update)
        scoring = bool(batch.prompt_score_rows)  # prompt log-probs (prefill rows: eager; raymoe.runner.prompt_logprobs)
        use_graph = self.graph_runner is not None and batch.graph_bs is not None
        rows = None  # a verify step replayed as decode rows, one per token (raymoe.runner.token_rows)
        if use_graph and batch.forward_mode.is_target_verify():
            if self.state_pool is None and not batch.use_tbo:  # recurrent layers step token after token
                rows = token_rows(batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.out_cache_loc,
                                  batch.input_ids, batch.graph_bs, batch.dispatch_capacity, batch.global_num_tokens)
            use_graph = rows is not None and self.graph_runner.can_run(rows)
        else:
            use_graph = use_graph and self.graph_runner.can_run(batch)
        fb = self.prepare(batch, for_graph=use_graph)
        graph_fb = fb
        if use_graph and rows is not None:
            graph_fb = ForwardBatch.from_worker_batch(rows, self.device, SamplingInputs.greedy(rows.batch_size))
            graph_fb.input_ids, graph_fb.attn_backend = fb.input_ids, self.attn_backend
            self.verify_graph_steps += 1
        verify = batch.forward_mode.is_target_verify() or any(batch.draft_lens)  # MIXED rows may verify drafts
        hidden = prompt = None
        drafting = self.drafter is not None and batch.draft_passes  # the step's decision, the same on every rank
        if use_graph and self.drafter is not None:  # the graphs return the hidden states the draft model reads
            logits, hidden = self.graph_runner.replay(graph_fb)
        elif use_graph:
            logits = self.graph_runner.replay(graph_fb)
        elif scoring:
            hidden = self.model(fb)
            logits, prompt = logits_and_scores(self.model, self.ops, hidden, batch, fb.dispatch_capacity, verify)
        elif drafting:
            hidden = self.model(fb)
            logits = self.model.compute_logits(hidden if verify else hidden[fb.sample_indices], fb.dispatch_capacity)
        else:
            logits = self.forward(fb, return_all_logits=verify)
        load = None
        if update is not None and update.report_load and self.eplb is not None:
            snapshot = self.eplb.load_snapshot()
            load = self.ops.copy_to_host([snapshot]) if snapshot is not None else None
        if fb.batch_size == 0:
            if drafting:  # the draft passes join the step's collectives on every rank
                self.drafter.draft(batch, fb.input_ids, hidden, [], None)
            return PendingStep(None, None, t0, load)
        if verify:  # speculative decoding: accept drafts, one more token per row (no log-prob rows)
            return finish_verify_step(self, batch, fb, logits, hidden, drafting, t0, load, prompt)
        raw = None
        if batch.grammar_rows:  # constrained rows only (raymoe.runner.grammar); others pay nothing
            if any(n is not None for n in fb.sampling.logprobs):  # log-probs are the model's, unmasked
                raw = logits.float().clone()
            logits, constrained = self.grammars.mask(batch.grammar_rows, batch.req_pool_indices, logits)
        penalized = self.penalties.rows_of(batch.req_pool_indices)
        if penalized:  # penalties and logit bias (raymoe.runner.penalties); log-probs stay the model's
            if raw is None and any(n is not None for n in fb.sampling.logprobs):
                raw = logits.float()
            logits = self.penalties.apply(logits, batch.req_pool_indices, penalized, penalized, batch.seq_lens)
        sampled = (self.sampler.sample(logits, fb.sampling) if raw is None
                   else self.sampler.sample(logits, fb.sampling, logprob_logits=raw))
        if penalized:
            self.penalties.record(sampled.next_ids, batch.req_pool_indices, penalized, batch.seq_lens)
        grammar = self.grammars.accept(constrained, sampled.next_ids) if batch.grammar_rows else None
        self.future_tokens.store(sampled.next_ids)
        drafts = ()
        if drafting:
            drafts = self.drafter.draft(batch, fb.input_ids, hidden, sampled.next_ids.tolist(), None)
        return PendingStep(sampled, self.ops.copy_to_host(sampled.device_tensors()), t0, load, grammar,
                           drafts=drafts, prompt=prompt)

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> StepOutput:
        """One step, answered: :meth:`launch_step`, then wait for its tokens (``PendingStep.result``)."""
        return self.launch_step(batch).result()
