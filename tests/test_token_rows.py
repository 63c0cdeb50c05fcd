"""A step's few new tokens per request as decode rows (``raymoe.runner.token_rows``) and the driver's bucket for a
verify step (``raymoe.runner.graph_buckets.plan_graph_bs`` with ``verify_rows``)."""

from __future__ import annotations

import pytest

from raymoe.runner.graph_buckets import plan_graph_bs
from raymoe.runner.token_rows import token_rows
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.step_plan import GroupPlan


def test_each_token_is_a_row_of_its_request_up_to_its_own_position():
    b = token_rows([7, 3], [10, 4], [3, 1], [100, 101, 102, 200], [5, 6, 7, 8], graph_bs=8, dispatch_capacity=8,
                   global_num_tokens=(4, 0))
    assert b.forward_mode == ForwardMode.DECODE
    assert b.req_pool_indices == [7, 7, 7, 3]
    assert b.seq_lens == [11, 12, 13, 5]  # token j of request i attends to positions [0, prefix + j]
    assert b.prefix_lens == [10, 11, 12, 4] and b.extend_lens == [1, 1, 1, 1]
    assert b.out_cache_loc == [100, 101, 102, 200] and b.input_ids == [5, 6, 7, 8]
    assert (b.graph_bs, b.dispatch_capacity, b.global_num_tokens) == (8, 8, (4, 0))


def test_no_tokens_is_an_idle_batch_with_the_steps_decisions():
    b = token_rows([], [], [], [], [], graph_bs=4, dispatch_capacity=4, global_num_tokens=(0, 6))
    assert b.forward_mode == ForwardMode.IDLE and (b.graph_bs, b.dispatch_capacity) == (4, 4)


def test_lists_that_do_not_match_are_refused():
    with pytest.raises(ValueError, match="one entry per request"):
        token_rows([1], [2, 3], [1], [0], [0], None)
    with pytest.raises(ValueError, match="for 2 tokens"):
        token_rows([1], [2], [2], [0], [0, 1], None)


def test_a_verify_group_counts_one_row_per_token_and_only_where_allowed():
    sizes = [1, 2, 4, 8, 16]
    verify, decode = GroupPlan(ForwardMode.TARGET_VERIFY, 9, 3), GroupPlan(ForwardMode.DECODE, 5, 5)
    assert plan_graph_bs([verify, decode], sizes, verify_rows=True) == 16  # 9 token rows
    assert plan_graph_bs([verify, GroupPlan.idle()], sizes, verify_rows=True) == 16
    assert plan_graph_bs([verify, decode], sizes) is None  # with two-batch overlap the driver does not allow it
    assert plan_graph_bs([GroupPlan(ForwardMode.TARGET_VERIFY, 17, 4)], sizes, verify_rows=True) is None
    assert plan_graph_bs([GroupPlan(ForwardMode.EXTEND, 2, 2), decode], sizes, verify_rows=True) is None
