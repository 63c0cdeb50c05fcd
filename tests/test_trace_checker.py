"""The collective-trace machinery itself, in one process: the comparison names the first differing call (rank,
index, both calls), the tracing transport records what the layers ask for and nothing when off, ``recording``
restores ``torch.distributed``, and the store check makes two ranks (threads over one in-memory store) raise at
the first differing call, at a skipped call, and at a peer that never arrives, instead of waiting forever.

The same checks across spawned gloo ranks with real models: ``tests/test_collective_traces.py``."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from raymoe.comm.groups import ParallelGroups
from raymoe.comm.trace import (
    END_OF_STEP,
    ROWS,
    CollectiveCall,
    CollectiveMismatch,
    CollectiveRecorder,
    TracingTransport,
    active_recorder,
    recording,
)
from raymoe.comm.trace_check import StoreCheck
from raymoe.comm.trace_compare import check_step_traces, compare_traces


def _call(op: str, group: str = "ep", shape=(4, 8), child=None, splits=None, via="") -> CollectiveCall:
    return CollectiveCall(op, group, (tuple(shape),), ("torch.float32",), child=child, splits=splits, via=via)


A, B, C = _call("all_gather"), _call("all_to_all_equal"), _call("exchange_counts", shape=(2,))


def test_equal_traces_pass_and_the_first_difference_is_named():
    compare_traces({0: [A, B, C], 1: [A, B, C]}, "ep", step=3)
    with pytest.raises(CollectiveMismatch) as e:
        compare_traces({0: [A, B, C, A], 1: [A, B, A, B]}, "ep", step=3)
    err = e.value
    assert (err.step, err.group, err.index, err.other, err.rank) == (3, "ep", 2, 0, 1)
    assert err.mine == str(C) and err.theirs == str(A)
    assert "step 3" in str(err) and "#2" in str(err) and "exchange_counts" in str(err) and "all_gather" in str(err)


def test_a_missing_call_child_or_shape_is_a_difference():
    with pytest.raises(CollectiveMismatch) as e:
        compare_traces({0: [A, B], 1: [A]}, "ep")
    assert (e.value.index, e.value.rank, e.value.theirs) == (1, 1, END_OF_STEP)
    with pytest.raises(CollectiveMismatch, match="child=B"):
        compare_traces({0: [_call("x", child=0)], 1: [_call("x", child=1)]}, "ep")
    with pytest.raises(CollectiveMismatch, match=r"\(4, 9\)"):
        compare_traces({0: [_call("x")], 1: [_call("x", shape=(4, 9))]}, "ep")
    with pytest.raises(CollectiveMismatch, match="carried differently"):
        compare_traces({0: [_call("x", via="direct")], 1: [_call("x", via="dist")]}, "ep")
    compare_traces({0: [A, _call("tp_only", group="tp")], 1: [A]}, "ep")  # other groups' calls are filtered out


def test_variable_splits_must_pair():
    rows = ((ROWS, 8),)
    ok = {0: [CollectiveCall("all_to_all_rows", "ep", rows, splits=((1, 2), (1, 3)))],
          1: [CollectiveCall("all_to_all_rows", "ep", rows, splits=((3, 0), (2, 0)))]}
    compare_traces(ok, "ep")
    bad = {0: ok[0], 1: [CollectiveCall("all_to_all_rows", "ep", rows, splits=((4, 0), (2, 0)))]}
    with pytest.raises(CollectiveMismatch, match="sending 3 rows to rank 1.*expecting 4 rows from rank 0"):
        compare_traces(bad, "ep")


def test_step_check_compares_whole_traces_inside_a_tp_group_and_ep_calls_across_groups():
    tp = _call("all_reduce", group="tp")
    check_step_traces([[tp, A], [tp, A], [A], [A]], tp_size=2, step=0)  # DP group 1 (ranks 2, 3) has no TP calls
    with pytest.raises(CollectiveMismatch) as e:  # rank 1 runs its EP call before the TP all-reduce
        check_step_traces([[tp, A], [A, tp], [A], [A]], tp_size=2)
    assert (e.value.group, e.value.index, e.value.rank) == (None, 0, 1)
    with pytest.raises(CollectiveMismatch) as e:
        check_step_traces([[tp, A], [tp, A], [B], [B]], tp_size=2)
    assert (e.value.group, e.value.rank) == ("ep", 2)
    with pytest.raises(ValueError, match="whole number"):
        check_step_traces([[A]] * 3, tp_size=2)


class _Work:
    def wait(self) -> None:
        return None


class _Inner:
    """A transport that only counts its calls (one process, nothing exchanged)."""

    ep_size, ep_rank, shm_calls = 2, 0, 0

    def all_to_all_equal(self, out, inp):
        self.shm_calls += 1
        return _Work()

    def all_gather(self, out, inp):
        self.shm_calls += 1
        return _Work()

    def exchange_counts(self, send_counts):
        self.shm_calls += 1
        return [1, 2], [1, 2], 2

    def all_to_all_rows(self, out, inp, out_splits, in_splits, max_pair_rows):
        self.shm_calls += 1
        return _Work()


def _groups(rank: int, world: int = 2) -> ParallelGroups:
    return ParallelGroups(world_rank=rank, world_size=world, dp_rank=rank, dp_size=world, ep_rank=rank,
                          ep_size=world, ep_group=object())


def test_tracing_transport_records_what_the_layers_ask_for_and_nothing_when_off():
    inner = _Inner()
    t = TracingTransport(inner)
    x, rows = torch.zeros(4, 8), torch.zeros(3, 8)
    t.all_to_all_equal(x, x)  # not recording: passed through, not logged
    rec = CollectiveRecorder(_groups(0))
    with recording(rec):
        assert active_recorder() is rec
        t.exchange_counts(torch.zeros(2, dtype=torch.int64))
        t.all_to_all_rows(torch.zeros(5, 8), rows, [2, 3], [1, 2], 3)
        t.all_gather(torch.zeros(8, 8), x).wait()
    assert active_recorder() is None and inner.shm_calls == 4 and t.shm_calls == 4  # attributes are inner's
    calls = rec.finish_step()
    assert [c.op for c in calls] == ["exchange_counts", "all_to_all_rows", "all_gather"]
    assert calls[1].shapes == ((ROWS, 8), (ROWS, 8)) and calls[1].splits == ((2, 3), (1, 2))
    assert calls[2].shapes == ((8, 8), (4, 8)) and calls[0].dtypes == ("torch.int64",)
    assert all(c.group == "ep" and c.via == "direct" and c.child is None for c in calls)
    assert rec.steps == [calls] and rec.step == 1


def test_recording_replaces_and_restores_the_dist_collectives():
    before = dist.all_reduce
    rec = CollectiveRecorder(_groups(0))
    with recording(rec):
        assert dist.all_reduce is not before and dist.all_reduce.__wrapped__ is before
        with pytest.raises(RuntimeError, match="already active"), recording(rec):
            pass
    assert dist.all_reduce is before and active_recorder() is None


def _run_ranks_in_threads(programs, timeout_s: float = 30.0) -> list:
    """Run ``programs[r](recorder)`` for two fake ranks over one in-memory store; per rank the exception (or
    None). A thread that is still running after ``timeout_s`` fails the test (the check must not hang)."""
    store = dist.HashStore()
    out: list = [None] * len(programs)

    def run(r):
        rec = CollectiveRecorder(_groups(r, len(programs)), StoreCheck(store, timeout_s=2.0))
        try:
            programs[r](rec)
        except CollectiveMismatch as e:
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(programs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "a rank of the store check hung"
    return out


def _issue(*calls):
    def program(rec: CollectiveRecorder) -> None:
        for call in calls:
            rec.record(call)
        rec.finish_step()
    return program


def test_store_check_passes_agreeing_ranks_over_several_steps():
    def steps(rec):
        for _ in range(3):
            _issue(A, B, C)(rec)

    assert _run_ranks_in_threads([steps, steps]) == [None, None]


def test_store_check_raises_on_both_ranks_at_the_first_differing_call():
    errors = _run_ranks_in_threads([_issue(A, B, C), _issue(A, C, C)])
    assert all(isinstance(e, CollectiveMismatch) and e.index == 1 and e.group == "ep" for e in errors)
    assert (errors[0].rank, errors[0].mine, errors[0].theirs) == (1, str(B), str(C))
    assert (errors[1].rank, errors[1].mine, errors[1].theirs) == (0, str(C), str(B))


def test_store_check_names_a_skipped_call_against_the_end_of_step():
    errors = _run_ranks_in_threads([_issue(A, B), _issue(A)])
    assert errors[0].index == 1 and errors[0].theirs == END_OF_STEP and errors[0].mine == str(B)
    assert errors[1].index == 1 and errors[1].mine == END_OF_STEP and errors[1].theirs == str(B)


def test_store_check_names_a_peer_that_never_arrives():
    def stalls(rec):
        rec.record(A)  # then it never announces another call (as if blocked elsewhere)

    errors = _run_ranks_in_threads([_issue(A, B), stalls])
    assert errors[0].rank == 1 and "nothing within 2 s" in errors[0].theirs and str(A) in errors[0].theirs
