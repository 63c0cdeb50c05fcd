"""Collective traces: every collective a rank issues, per step, in order (op, group, order, shapes, dtypes).

Ranks that issue different collective sequences hang a cluster (or, worse, pair the wrong buffers). A trace makes
such a disagreement visible: a :class:`CollectiveRecorder` logs each call as a :class:`CollectiveCall`, and
:func:`compare_traces` / :func:`check_step_traces` name the first call where the ranks of a group differ. Two
hooks feed the recorder while :func:`recording` is active:

* :class:`TracingTransport` wraps a group's :class:`~raymoe.comm.transport.EpTransport` (every MoE exchange and the
  vocabulary-split LM head; :func:`traced_groups` installs it in ``ParallelGroups.ep_transport``). It records the
  exchange as the layers ask for it, whichever carrier (shared memory, ``torch.distributed``) runs it, and which
  of the two it took (``via``).
* :func:`recording` replaces the ``torch.distributed`` collectives (``dist.all_reduce``, ``dist.all_gather`` ...)
  for its duration, so the TP collectives of ``raymoe.comm.groups`` and any other ``dist`` call a forward makes
  are recorded too (calls a transport makes inside a recorded exchange are its implementation: not recorded
  again). Code that imported a collective by name (``from torch.distributed import all_reduce``) escapes it;
  raymoe calls them as ``dist.<name>``.

The op executors (``raymoe.overlap.operations``) tell the active recorder which op runs and which two-batch-overlap
child (0 = A, 1 = B) it belongs to, so a call names where it came from, and a rank that pairs child A's exchange
with another rank's child B's is caught even where the two calls have the same shapes.

Cost when off: :class:`TracingTransport` and the executors read one module global per call or op; nothing in
``torch.distributed`` is replaced. Comparing finished traces is
``raymoe.comm.trace_compare``; agreement before each call (a mismatch raised before the collective that would hang)
is ``raymoe.comm.trace_check``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.distributed as dist

from raymoe.comm.ep_transport import ep_transport_of
from raymoe.comm.groups import ParallelGroups
from raymoe.comm.transport import EpTransport, Work

ROWS = "*"  # a shape entry each rank sizes for itself (rows of a variable-split all-to-all)

#: ``torch.distributed`` functions :func:`recording` replaces (those this torch build has).
DIST_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single", "all_to_all",
                    "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter",
                    "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object",
                    "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv")


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as a rank issued it.

    Attributes:
        op: the transport method (``all_to_all_rows``, ``exchange_counts`` ...) or ``torch.distributed`` function.
        group: ``"tp"``, ``"ep"``, ``"world"`` (the default group) or ``"other"``.
        shapes: the tensors' shapes, in argument order (a list of tensors: its length, then the first one's
            shape); :data:`ROWS` where ranks legitimately differ (rows of a variable split).
        dtypes: the tensors' dtypes, as ``str(dtype)``.
        child: the two-batch-overlap child that issued it (0, 1), None outside TBO.
        where: the op that was running (``SparseMoeBlock.op_dispatch_a``), "" outside the layer ops; not compared.
        via: what carried a transport exchange (``"dist"``: ``torch.distributed``, ``"direct"``: the transport's own
            path, such as shared memory); "" for ``torch.distributed`` calls. Known after the call.
        splits: ``(out_splits, in_splits)`` rows per peer of a variable split (rank-local; checked pairwise).
    """

    op: str
    group: str
    shapes: tuple[tuple[int | str, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    child: int | None = None
    where: str = ""
    via: str = ""
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def key(self) -> tuple:
        """What every rank of the group must issue alike, known before the call (``via`` is compared after)."""
        return self.op, self.group, self.shapes, self.dtypes, self.child

    def __str__(self) -> str:
        text = f"{self.group} {self.op} shapes={list(self.shapes)} dtypes={list(self.dtypes)}"
        if self.child is not None:
            text += f" child={'AB'[self.child]}"
        if self.via:
            text += f" via={self.via}"
        return text + (f" in {self.where}" if self.where else "")


END_OF_STEP = "<end of step>"


class CollectiveMismatch(RuntimeError):
    """Ranks of a group issue different collectives (or one issues none where the others do).

    Attributes:
        step: the step (recorder's count, or the caller's index). group: the group's name. index: the call's
            position among the step's calls of that group (of all calls when ``group`` is None). rank: the rank that
            differs; other: the rank it was compared with. mine, theirs: the two calls (``other``'s and ``rank``'s),
            as text (:data:`END_OF_STEP` where a rank has no such call).
    """

    def __init__(self, step: object, group: str | None, index: int, other: int, mine: str, rank: int, theirs: str,
                 detail: str = ""):
        self.step, self.group, self.index, self.other, self.mine, self.rank, self.theirs = (
            step, group, index, other, mine, rank, theirs)
        where = f"{group} collective" if group else "collective"
        super().__init__(f"step {step}: ranks disagree at {where} #{index}{detail}: rank {other} issues {mine}; "
                         f"rank {rank} issues {theirs}")


class StepCheck(Protocol):
    """Called by a recorder before each call and at the end of each step (``raymoe.comm.trace_check``)."""

    def before(self, recorder: CollectiveRecorder, call: CollectiveCall, index: int) -> None: ...

    def end_step(self, recorder: CollectiveRecorder, counts: Mapping[str, int]) -> None: ...


def op_label(op: object) -> str:
    """A short name of an op (``Class.method``), "" for None."""
    if op is None:
        return ""
    return getattr(op, "__qualname__", None) or type(op).__name__


def group_members(groups: ParallelGroups) -> dict[str, tuple[int, ...]]:
    """World ranks of each group this rank is in: its TP group (ranks ``dp_rank * tp_size ...``), the EP group and
    the world (also used for ``"other"`` groups, whose members the recorder does not know)."""
    world = tuple(range(groups.world_size))
    tp0 = groups.dp_rank * groups.tp_size
    return {"tp": tuple(range(tp0, tp0 + groups.tp_size)), "ep": world if groups.ep_size > 1 else (groups.world_rank,),
            "world": world, "other": world}


class CollectiveRecorder:
    """Records one rank's collectives, step by step.

    Args:
        groups: the rank's groups (names its process groups and their members).
        check: optional pre-call agreement (``raymoe.comm.trace_check.StoreCheck``).
    Attributes:
        calls: this step's calls so far. steps: the traces of finished steps. step: the current step's number.
        child, where: set by the op executors (the running TBO child and op).
    """

    def __init__(self, groups: ParallelGroups, check: StepCheck | None = None):
        self.rank = groups.world_rank
        self.members = group_members(groups)
        self._names = {id(g): name for g, name in ((groups.tp_group, "tp"), (groups.ep_group, "ep")) if g is not None}
        self.check = check
        self.step = 0
        self.calls: list[CollectiveCall] = []
        self.steps: list[list[CollectiveCall]] = []
        self.child: int | None = None
        self.where: object = None
        self._counts: dict[str, int] = {}
        self._in_transport = 0
        self._inner_dist = False

    def group_name(self, group: object) -> str:
        """``"tp"``/``"ep"`` for the rank's groups, ``"world"`` for None or the default group, else ``"other"``."""
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        return self._names.get(id(group), "other")

    def record(self, call: CollectiveCall) -> int:
        """Log ``call`` (stamped with the running child and op), run the pre-call check; returns its position in
        :attr:`calls`.

        Raises:
            CollectiveMismatch: from the check, before the collective runs.
        """
        call = replace(call, child=self.child, where=op_label(self.where))
        index = self._counts.get(call.group, 0)
        self._counts[call.group] = index + 1
        self.calls.append(call)
        if self.check is not None:
            self.check.before(self, call, index)
        return len(self.calls) - 1

    def around(self, call: CollectiveCall, run: Callable[[], Any]) -> Any:
        """Record a transport exchange, run it (``torch.distributed`` calls inside it set ``via="dist"``)."""
        i = self.record(call)
        self._in_transport += 1
        self._inner_dist = False
        try:
            result = run()
        finally:
            self._in_transport -= 1
        self.calls[i] = replace(self.calls[i], via="dist" if self._inner_dist else "direct")
        return result

    def finish_step(self) -> list[CollectiveCall]:
        """Close the step: run the check's end-of-step agreement, keep the trace in :attr:`steps` and return it."""
        calls, counts = self.calls, dict(self._counts)
        self.calls, self._counts = [], {}
        self.child = self.where = None
        self.steps.append(calls)
        if self.check is not None:
            self.check.end_step(self, counts)
        self.step += 1
        return calls


_ACTIVE: CollectiveRecorder | None = None


def active_recorder() -> CollectiveRecorder | None:
    """The recorder of the running :func:`recording`, or None (the common case: nothing is recorded)."""
    return _ACTIVE


def _shape_and_dtype(value: object) -> tuple[tuple[int, ...], str] | None:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), str(value.dtype)
    if isinstance(value, list | tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return (len(value), *value[0].shape), str(value[0].dtype)
    return None


def _dist_call(recorder: CollectiveRecorder, name: str, signature: inspect.Signature, args, kwargs
               ) -> CollectiveCall:
    """The :class:`CollectiveCall` of a ``torch.distributed`` call (tensor arguments in order; rows of a variable
    split as :data:`ROWS`)."""
    bound = signature.bind_partial(*args, **kwargs).arguments
    out_splits, in_splits = bound.get("output_split_sizes"), bound.get("input_split_sizes")
    shapes, dtypes = [], []
    for arg, value in bound.items():
        found = _shape_and_dtype(value)
        if found is None:
            continue
        shape = found[0]
        if (arg == "output" and out_splits is not None) or (arg == "input" and in_splits is not None):
            shape = (ROWS, *shape[1:])
        shapes.append(shape)
        dtypes.append(found[1])
    splits = None
    if out_splits is not None or in_splits is not None:
        splits = (tuple(out_splits or ()), tuple(in_splits or ()))
    return CollectiveCall(name, recorder.group_name(bound.get("group")), tuple(shapes), tuple(dtypes), splits=splits)


def _traced(name: str, fn: Callable) -> Callable:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        rec = _ACTIVE
        if rec is not None:
            if rec._in_transport:
                rec._inner_dist = True
            else:
                rec.record(_dist_call(rec, name, signature, args, kwargs))
        return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def recording(recorder: CollectiveRecorder) -> Iterator[CollectiveRecorder]:
    """Record this process's collectives into ``recorder`` until the block ends (``torch.distributed``'s
    collectives are replaced meanwhile and restored after).

    Raises:
        RuntimeError: a recording is already active in this process.
    """
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("a collective recording is already active in this process")
    originals = {name: getattr(dist, name) for name in DIST_COLLECTIVES if hasattr(dist, name)}
    for name, fn in originals.items():
        setattr(dist, name, _traced(name, fn))
    _ACTIVE = recorder
    try:
        yield recorder
    finally:
        _ACTIVE = None
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _ep_call(op: str, *tensors: torch.Tensor, rows: bool = False, splits=None) -> CollectiveCall:
    shapes = tuple(((ROWS, *t.shape[1:]) if rows else tuple(t.shape)) for t in tensors)
    return CollectiveCall(op, "ep", shapes, tuple(str(t.dtype) for t in tensors), splits=splits)


class TracingTransport:
    """An :class:`~raymoe.comm.transport.EpTransport` that records each exchange into the active recorder, then
    hands it to ``inner`` (unchanged when nothing records). Other attributes (``shm_calls`` ...) are ``inner``'s."""

    def __init__(self, inner: EpTransport):
        self.inner = inner
        self.ep_size = inner.ep_size
        self.ep_rank = inner.ep_rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def all_to_all_equal(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        rec = _ACTIVE
        if rec is None:
            return self.inner.all_to_all_equal(out, inp)
        return rec.around(_ep_call("all_to_all_equal", out, inp), lambda: self.inner.all_to_all_equal(out, inp))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        rec = _ACTIVE
        if rec is None:
            return self.inner.all_gather(out, inp)
        return rec.around(_ep_call("all_gather", out, inp), lambda: self.inner.all_gather(out, inp))

    def exchange_counts(self, send_counts: torch.Tensor) -> tuple[list[int], list[int], int]:
        rec = _ACTIVE
        if rec is None:
            return self.inner.exchange_counts(send_counts)
        return rec.around(_ep_call("exchange_counts", send_counts), lambda: self.inner.exchange_counts(send_counts))

    def all_to_all_rows(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                        max_pair_rows: int) -> Work:
        rec = _ACTIVE
        if rec is None:
            return self.inner.all_to_all_rows(out, inp, out_splits, in_splits, max_pair_rows)
        call = _ep_call("all_to_all_rows", out, inp, rows=True, splits=(tuple(out_splits), tuple(in_splits)))
        return rec.around(call, lambda: self.inner.all_to_all_rows(out, inp, out_splits, in_splits, max_pair_rows))


def traced_groups(groups: ParallelGroups) -> ParallelGroups:
    """``groups`` whose EP transport records (:class:`TracingTransport` around the platform's transport, or around
    ``DistEpTransport``); unchanged with one EP rank. Build the model with the result."""
    if groups.ep_size < 2 or isinstance(groups.ep_transport, TracingTransport):
        return groups
    return replace(groups, ep_transport=TracingTransport(ep_transport_of(groups)))
