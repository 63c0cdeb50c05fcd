"""A step with a few new tokens per request as a decode batch of one row per token, so it replays a decode graph.

A verify step (``ForwardMode.TARGET_VERIFY``) computes, for request ``i``, ``e_i`` tokens at positions
``p_i .. p_i + e_i - 1``; token ``j`` attends to the request's positions ``[0, p_i + j]``, its own draft chain
causally. That is exactly a decode row of the same request with sequence length ``p_i + j + 1``: the attention of a
decode step stores every row's keys and values first and then lets each row attend over its table up to its
length, so a row sees the keys its request's earlier tokens of the same step stored, and none of the later ones.
Every other layer works per token. A verify step of ``T = sum(e_i)`` tokens is therefore a decode batch of ``T``
rows, and replays the decode graph of a bucket that holds ``T`` (SGLang captures separate verify graphs per
``(bs, num_draft_tokens)``; here the decode graphs serve any mix of draft lengths). The draft model's first pass
after a step (``raymoe.runner.mtp_drafter``) uses the same form over the positions the step made final.

What it does not hold for: layers with a recurrent state per request (linear attention), which must step token
after token; those ranks verify eagerly (``ModelRunner``). The driver plans a verify step's bucket only without
two-batch overlap (``raymoe.runner.graph_buckets.plan_graph_bs``): a split at half the rows could put a request's
later tokens in the half that attends first.
"""

from __future__ import annotations

from collections.abc import Sequence

from raymoe.step.forward_mode import ForwardMode
from raymoe.step.worker_batch import ModelWorkerBatch


def token_rows(req_pool_indices: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int],
               out_cache_loc: Sequence[int], input_ids: Sequence[int], graph_bs: int | None,
               dispatch_capacity: int | None = None, global_num_tokens: tuple[int, ...] = ()) -> ModelWorkerBatch:
    """A DECODE batch with one row per token (module docstring): token ``j`` of request ``i`` becomes a row of
    ReqToTokenPool row ``req_pool_indices[i]`` with sequence length ``prefix_lens[i] + j + 1``, its slot and input id
    taken in order from ``out_cache_loc`` / ``input_ids`` (``T = sum(extend_lens)`` each).

    Args:
        req_pool_indices, prefix_lens, extend_lens: per request (``bs`` each). out_cache_loc, input_ids: per token.
        graph_bs: the decode graph bucket the rows replay (None: eager). dispatch_capacity, global_num_tokens: the
            step's shared decisions, as the source batch had them.

    Raises:
        ValueError: the per-request lists differ in length, or the per-token lists do not have ``T`` entries.
    """
    if not len(req_pool_indices) == len(prefix_lens) == len(extend_lens):
        raise ValueError("token_rows: req_pool_indices, prefix_lens and extend_lens need one entry per request")
    tokens = sum(extend_lens)
    if len(out_cache_loc) != tokens or len(input_ids) != tokens:
        raise ValueError(f"token_rows: {len(out_cache_loc)} slots and {len(input_ids)} ids for {tokens} tokens")
    rows: list[int] = []
    seq_lens: list[int] = []
    for row, pre, ext in zip(req_pool_indices, prefix_lens, extend_lens, strict=True):
        rows += [row] * ext
        seq_lens += range(pre + 1, pre + ext + 1)
    if not rows:
        return ModelWorkerBatch.idle().with_step_decisions(global_num_tokens, False, graph_bs, dispatch_capacity)
    return ModelWorkerBatch(ForwardMode.DECODE, list(input_ids), rows, seq_lens, [s - 1 for s in seq_lens],
                            [1] * tokens, list(out_cache_loc), graph_bs=graph_bs, dispatch_capacity=dispatch_capacity,
                            global_num_tokens=global_num_tokens)
