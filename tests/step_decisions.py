"""``check_step_decisions``: what every step the driver sends must satisfy so that all ranks run one collective
sequence, stated from the documented rules (``raymoe.overlap.decision``, ``raymoe.runner.graph_buckets``,
``raymoe.comm.a2a_plan``) rather than by calling the driver's planners again.

Agreement: every DP group's batch carries the same ``use_tbo``, ``graph_bs``, ``dispatch_capacity`` and
``global_num_tokens``. Consistency with the batches:

* ``global_num_tokens`` are the groups' token counts; some group has work (an all-IDLE step is never sent);
* TBO runs only with TBO on, never with a MIXED group, on one mode (EXTEND steps without IDLE groups), above the
  token bound, with both children of every busy group non-empty (the ranks' own split); and it runs whenever all
  of that holds;
* a graph bucket only on DECODE/IDLE steps with a decode, or, without TBO, steps whose busy groups decode or
  verify (a verify group counts one row per token), the smallest captured size holding every group's rows (and
  every such step with a size holding them replays one);
* the low-latency capacity only when the step's a2a mode is low-latency, equal to the bucket on graph steps, else
  the busiest group's tokens within the per-rank bound; it holds every group's tokens, and each TBO child's
  capacity holds that child's tokens (padded graph batches included).
"""

from __future__ import annotations

from collections.abc import Sequence

from raymoe.comm.a2a_plan import child_dispatch_capacity
from raymoe.comm.expert_input import resolve_a2a_mode
from raymoe.config import OverlapConfig
from raymoe.overlap.split import compute_split
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.worker_batch import ModelWorkerBatch

SHARED = ("use_tbo", "graph_bs", "dispatch_capacity", "global_num_tokens")


def _children_tokens(mode: ForwardMode, extend_lens: Sequence[int], threshold: float) -> tuple[int, int]:
    split = compute_split(mode, extend_lens, threshold)
    return split.token_index, sum(extend_lens) - split.token_index


def _tbo_possible(batches: Sequence[ModelWorkerBatch], cfg: OverlapConfig) -> bool:
    active = [b for b in batches if b.forward_mode != ForwardMode.IDLE]
    modes = {b.forward_mode for b in active}
    if not cfg.enable_tbo or len(modes) != 1 or ForwardMode.MIXED in modes:
        return False
    mode = modes.pop()
    if mode == ForwardMode.EXTEND and len(active) < len(batches):
        return False
    bound = cfg.tbo_min_tokens_decode if mode == ForwardMode.DECODE else cfg.tbo_min_tokens_extend
    if max(b.num_tokens for b in active) < bound:
        return False
    return all(min(_children_tokens(mode, b.extend_lens, cfg.tbo_token_distribution_threshold)) > 0 for b in active)


def check_step_decisions(batches: Sequence[ModelWorkerBatch], dp_size: int, overlap: OverlapConfig,
                         capture_sizes: Sequence[int], a2a_mode: str, max_tokens_per_rank: int) -> None:
    """Assert the module docstring's rules for one step's ``batches`` (one per DP group).

    Raises:
        AssertionError: naming the rule and the step's modes and decisions.
    """
    first = batches[0]
    what = (tuple(b.forward_mode.name for b in batches), tuple(b.num_tokens for b in batches),
            {f: getattr(first, f) for f in SHARED})
    assert len(batches) == dp_size, what
    for field in SHARED:
        assert len({getattr(b, field) for b in batches}) == 1, (f"groups disagree on {field}", what)
    modes = [b.forward_mode for b in batches]
    tokens = [b.num_tokens for b in batches]
    assert first.global_num_tokens == tuple(tokens), what
    assert any(m != ForwardMode.IDLE for m in modes), ("an all-IDLE step was sent", what)

    assert first.use_tbo == _tbo_possible(batches, overlap), ("TBO decision", what)
    if first.use_tbo:
        assert ForwardMode.MIXED not in modes and overlap.enable_tbo, what

    decode_step = all(m.is_decode_or_idle() for m in modes)
    graphed = decode_step or (not first.use_tbo and all(m.is_decode_or_idle() or m.is_target_verify() for m in modes))
    max_bs = max(b.num_tokens if b.forward_mode.is_target_verify() else b.batch_size for b in batches)
    holding = [s for s in sorted(capture_sizes) if s >= max_bs]
    want_graph = holding[0] if graphed and holding else None
    assert first.graph_bs == want_graph, ("graph bucket", what, list(capture_sizes))

    capacity = first.dispatch_capacity
    if resolve_a2a_mode(a2a_mode, decode_step) == "normal":
        assert capacity is None, ("normal-mode step with a capacity", what)
    elif first.graph_bs is not None:
        assert capacity == first.graph_bs, ("graph step's capacity is not its bucket", what)
    else:
        want = max(max(tokens), 1)
        assert capacity == (want if want <= max_tokens_per_rank else None), ("eager low-latency capacity", what)
    if capacity is None:
        return
    assert all(t <= capacity for t in tokens), ("capacity below a group's tokens", what)
    if first.use_tbo:
        for b in batches:
            child_cap = child_dispatch_capacity(capacity, b.forward_mode)
            rows = [1] * first.graph_bs if first.graph_bs is not None else b.extend_lens  # a replay splits padding
            mode = ForwardMode.DECODE if first.graph_bs is not None else b.forward_mode
            assert max(_children_tokens(mode, rows, overlap.tbo_token_distribution_threshold)) <= child_cap, what
