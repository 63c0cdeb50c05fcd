"""Compare the collective traces of a step's ranks (``raymoe.comm.trace``) and name the first call they disagree on.

Rules, per step:

* the ranks of one TP group run the same program on the same batch, so their whole traces must be equal, call by
  call (TP and EP calls in the same order);
* every rank must issue the same EP and world calls (filtered to that group), whatever its DP group's batch: an
  IDLE rank too;
* a variable-split all-to-all must pair: the rows rank ``s`` sends rank ``d`` are the rows ``d`` expects from ``s``;
* a transport exchange must take the same carrier on every rank (``via``; the CPU shared-memory transport picks it
  from numbers every rank shares).

"Equal" is :meth:`CollectiveCall.key`: op, group, shapes (rows of a variable split excepted), dtypes and the TBO
child that issued the call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from raymoe.comm.trace import END_OF_STEP, CollectiveCall, CollectiveMismatch

EP_LIKE_GROUPS = ("ep", "world", "other")


def _text(call: CollectiveCall | None) -> str:
    return END_OF_STEP if call is None else str(call)


def compare_traces(traces: Mapping[int, Sequence[CollectiveCall]], group: str | None = None,
                   step: object = "?") -> None:
    """Check that the ranks in ``traces`` issued the same calls in the same order.

    Args:
        traces: world rank -> that rank's calls of one step; every member of the group, and only them.
        group: compare only the calls of this group (``"ep"`` ...); None: every call, in order.
        step: named in the error.
    Raises:
        CollectiveMismatch: at the first position where some rank's call differs from the lowest rank's (or one of
            them has no call there; the lowest differing rank is named), or where a variable split does not pair.
    """
    ranks = sorted(traces)
    seqs = {r: [c for c in traces[r] if group is None or c.group == group] for r in ranks}
    ref = ranks[0]
    for i in range(max((len(s) for s in seqs.values()), default=0)):
        a = seqs[ref][i] if i < len(seqs[ref]) else None
        for r in ranks[1:]:
            b = seqs[r][i] if i < len(seqs[r]) else None
            if a is None or b is None or a.key() != b.key():
                raise CollectiveMismatch(step, group, i, ref, _text(a), r, _text(b))
            if a.via and b.via and a.via != b.via:
                raise CollectiveMismatch(step, group, i, ref, str(a), r, str(b), " (carried differently)")
        if a is not None and a.splits is not None:
            _check_splits(step, group, i, {r: seqs[r][i] for r in ranks})


def _check_splits(step: object, group: str | None, index: int, calls: Mapping[int, CollectiveCall]) -> None:
    """Rows rank ``s`` sends ``d`` (``in_splits[d]``) must be the rows ``d`` receives from ``s``
    (``out_splits[s]``); ranks are indexed by their position among ``calls``' ranks (EP rank = world rank)."""
    ranks = sorted(calls)
    if any(c.splits is None or len(c.splits[0]) != len(ranks) or len(c.splits[1]) != len(ranks)
           for c in calls.values()):
        return
    for si, s in enumerate(ranks):
        for di, d in enumerate(ranks):
            sent, expected = calls[s].splits[1][di], calls[d].splits[0][si]
            if sent != expected:
                raise CollectiveMismatch(step, group, index, s, f"{calls[s]} sending {sent} rows to rank {d}", d,
                                         f"{calls[d]} expecting {expected} rows from rank {s}", " (row counts)")


def check_step_traces(traces: Sequence[Sequence[CollectiveCall]], tp_size: int = 1, step: object = "?") -> None:
    """Check one step's traces of a whole world (the module docstring's rules).

    Args:
        traces: the calls of each world rank, indexed by world rank (rank ``r`` is in TP group ``r // tp_size``).
        tp_size: ranks per TP group.
        step: named in the error.
    Raises:
        CollectiveMismatch: the first disagreement (TP groups first, then the EP, world and other groups).
        ValueError: the world is not a whole number of TP groups.
    """
    world = len(traces)
    if tp_size < 1 or world % tp_size:
        raise ValueError(f"{world} traces are not a whole number of TP groups of {tp_size}")
    if tp_size > 1:
        for start in range(0, world, tp_size):
            compare_traces({r: traces[r] for r in range(start, start + tp_size)}, None, step)
    for group in EP_LIKE_GROUPS:
        compare_traces(dict(enumerate(traces)), group, step)
