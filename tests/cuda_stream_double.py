"""A strict CPU double of ``torch.cuda``'s streams and events, with a race detector over every ATen op.

It offers what raymoe's CUDA platform calls (``raymoe.platform.cuda.streams``): ``Stream(device=None,
priority=0)`` with ``wait_event``, ``wait_stream``, ``record_event``, ``query``, ``synchronize``;
``Event(enable_timing=False, blocking=False, interprocess=False)`` with ``record(stream=None)``,
``wait(stream=None)``, ``query``, ``synchronize``; ``current_stream(device=None)``, ``stream(s)`` (a context;
``None`` changes nothing), ``set_stream``, ``synchronize``; and ``Tensor.record_stream(stream)``. Inside
``with double:`` every ATen op is attributed to the current stream and logged (``double.log``: op name, stream
name).

The happens-before model is CUDA's: each stream runs its ops in issue order; an event snapshots what its stream
had issued when it was recorded; ``wait_event`` orders everything issued later on the waiting stream after that
snapshot; a host wait (``Event.synchronize``, ``Stream.synchronize``, a ``_local_scalar_dense`` read) orders
everything issued afterwards on any stream after what it waited for. Vector clocks per stream track it.

What it reports (``double.errors``; :meth:`CudaStreamDouble.check` raises on any):

* a race: two accesses to overlapping bytes of one storage from different streams, at least one a write,
  without an event (or host wait) ordering the first before the second. Byte ranges are exact for whole views
  and for rows selected on dim 0 by an int64 index (``index_put_``, ``index``, ``index_select``,
  ``index_copy_``), so two streams writing different KV slots of one cache do not conflict;
* a free without protection: a storage allocated on stream A (the stream current when an op produced it) is freed
  on the host while a use on stream B is neither ordered before A's work so far (kept alive until A waited for B)
  nor covered by ``record_stream(B)``; the caching allocator would hand the memory to A's next allocation while B
  may still read it;
* (with ``scratch_row0``) row 0 of a tensor the predicate names is garbage by definition (the KV pools' dummy
  slot, which every padding row writes and reads): row-indexed accesses to it are not tracked;
* misuse the real library accepts silently: waiting on an event never recorded (a no-op on a GPU, so the intended
  dependency is missing), ``record_stream`` with something that is not one of its streams.

Stricter than CUDA where CUDA would silently run a race; never more lenient. Tensors that existed before ``with``
(weights, KV pools) count as allocated on the default stream and are never freed here.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

_aten = torch.ops.aten
_ROW_WRITES = {_aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default}
_ROW_READS = {_aten.index.Tensor}
_HOST_READS = {_aten._local_scalar_dense.default}


class StreamDoubleError(AssertionError):
    """A stream-ordering error the double found (the message lists them)."""


class Stream(torch.Stream):
    """``torch.cuda.Stream``; made through :class:`CudaStreamDouble` (``double.Stream()``). A ``torch.Stream`` (of
    the CPU device) so that ``Tensor.record_stream`` accepts it as it accepts a CUDA stream; outside ``with
    double:`` the real ``record_stream`` refuses a CPU tensor."""

    def __new__(cls, double: CudaStreamDouble, name: str):
        return super().__new__(cls, device="cpu")

    def __init__(self, double: CudaStreamDouble, name: str):
        self._double = double
        self.name = name
        self.clock: dict[str, int] = {name: 0}

    def __eq__(self, other) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def wait_event(self, event: Event) -> None:
        self._double._check_event(event, "Stream.wait_event")
        if event.snapshot is None:
            self._double.errors.append(f"{self.name} waits on an event that was never recorded (a no-op on CUDA)")
            return
        _merge(self.clock, event.snapshot)

    def wait_stream(self, stream: Stream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        event = event or self._double.Event()
        event.record(self)
        return event

    def query(self) -> bool:
        """True only once the host has waited for the recorded work (an infinitely slow device: a caller that
        polls must still wait before it reads)."""
        if self.snapshot is None:
            return True
        return all(self._double._host_clock.get(name, 0) >= tick for name, tick in self.snapshot.items())

    def synchronize(self) -> None:
        self._double._host_waits_for(dict(self.clock))

    def __repr__(self) -> str:
        return f"<Stream {self.name}>"


class Event:
    """``torch.cuda.Event``; made through :class:`CudaStreamDouble` (``double.Event()``)."""

    def __init__(self, double: CudaStreamDouble, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self._double = double
        self.snapshot: dict[str, int] | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else self._double.current_stream()
        self._double._check_stream(stream, "Event.record")
        self.snapshot = dict(stream.clock)

    def wait(self, stream: Stream | None = None) -> None:
        (stream if stream is not None else self._double.current_stream()).wait_event(self)

    def query(self) -> bool:
        """True only once the host has waited for the recorded work (an infinitely slow device: a caller that
        polls must still wait before it reads)."""
        if self.snapshot is None:
            return True
        return all(self._double._host_clock.get(name, 0) >= tick for name, tick in self.snapshot.items())

    def synchronize(self) -> None:
        if self.snapshot is None:
            return  # CUDA: an event never recorded counts as complete
        self._double._host_waits_for(self.snapshot)


def _merge(into: dict[str, int], other: dict[str, int]) -> None:
    for name, tick in other.items():
        if tick > into.get(name, 0):
            into[name] = tick


@dataclass
class _Access:
    stream: str
    tick: int
    write: bool
    spans: tuple[tuple[int, int], ...]
    op: str


@dataclass
class _Storage:
    alloc_stream: str
    accesses: list[_Access] = field(default_factory=list)
    recorded_on: set[str] = field(default_factory=set)


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> bool:
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][0] < b[j][1] and b[j][0] < a[i][1]:
            return True
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return False


def _spans(t: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[tuple[int, int], ...]:
    """Byte ranges of ``t``'s storage that the view (or its ``rows`` on dim 0) covers, sorted and merged."""
    if t.numel() == 0:
        return ()
    es, off = t.element_size(), t.storage_offset()
    if rows is None or t.dim() == 0:
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        return ((off * es, (off + extent) * es),)
    rest = 1 + sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride()[1:], strict=True))
    starts = sorted({int(r) % t.shape[0] for r in rows.reshape(-1).tolist()})
    merged: list[list[int]] = []
    for r in starts:
        lo = (off + r * t.stride(0)) * es
        hi = lo + rest * es
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple((lo, hi) for lo, hi in merged)


class CudaStreamDouble:
    """The double (module docstring). Use ``with double:`` around the code under test, then :meth:`check`."""

    def __init__(self, scratch_row0: Callable[[torch.Tensor], bool] | None = None):
        self.scratch_row0 = scratch_row0
        self._host_clock: dict[str, int] = {}
        self._names = itertools.count(1)
        self.default = Stream(self, "default")
        self.streams: list[Stream] = [self.default]
        self._current = self.default
        self._storages: dict[int, _Storage] = {}
        self.errors: list[str] = []
        self.log: list[tuple[str, str]] = []
        self._modes: list = []

    # ---- the torch.cuda API ----
    def Stream(self, device=None, priority: int = 0) -> Stream:  # noqa: N802 - torch.cuda.Stream
        stream = Stream(self, f"stream{next(self._names)}")
        self.streams.append(stream)
        return stream

    def Event(self, enable_timing: bool = False, blocking: bool = False,  # noqa: N802 - torch.cuda.Event
              interprocess: bool = False) -> Event:
        return Event(self, enable_timing, blocking, interprocess)

    def current_stream(self, device=None) -> Stream:
        return self._current

    def set_stream(self, stream: Stream) -> None:
        self._check_stream(stream, "set_stream")
        self._current = stream

    @contextlib.contextmanager
    def stream(self, stream: Stream | None):
        if stream is None:
            yield
            return
        self._check_stream(stream, "torch.cuda.stream")
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous

    def synchronize(self, device=None) -> None:
        everything: dict[str, int] = {}
        for s in self.streams:
            _merge(everything, s.clock)
        self._host_waits_for(everything)

    # ---- checks ----
    def _check_stream(self, stream, what: str) -> None:
        if not isinstance(stream, Stream) or stream._double is not self:
            raise TypeError(f"{what}: expected a stream of this double, got {stream!r}")

    def _check_event(self, event, what: str) -> None:
        if not isinstance(event, Event) or event._double is not self:
            raise TypeError(f"{what}: expected an event of this double, got {event!r}")

    def _host_waits_for(self, snapshot: dict[str, int]) -> None:
        _merge(self._host_clock, snapshot)
        for s in self.streams:
            _merge(s.clock, snapshot)

    def _ordered(self, access: _Access, stream: Stream) -> bool:
        return access.stream == stream.name or stream.clock.get(access.stream, 0) >= access.tick

    def check(self) -> None:
        """Raise :class:`StreamDoubleError` listing every error found so far (then forget them)."""
        errors, self.errors = self.errors, []
        if errors:
            raise StreamDoubleError(f"{len(errors)} stream error(s):\n" + "\n".join(errors[:20]))

    # ---- tracking ----
    def _storage(self, t: torch.Tensor, allocated: bool) -> _Storage:
        storage = t.untyped_storage()
        key = id(storage)
        entry = self._storages.get(key)
        if entry is None:
            entry = _Storage(self._current.name if allocated else self.default.name)
            self._storages[key] = entry
            weakref.finalize(storage, self._freed, key)
        return entry

    def _freed(self, key: int) -> None:
        entry = self._storages.pop(key, None)
        if entry is None:
            return
        alloc = next(s for s in self.streams if s.name == entry.alloc_stream)
        for a in entry.accesses:
            if a.stream != alloc.name and a.stream not in entry.recorded_on and not self._ordered(a, alloc):
                self.errors.append(f"freed: a storage allocated on {alloc.name} was freed while its use by "
                                   f"{a.op} on {a.stream} was neither waited for by {alloc.name} nor covered by "
                                   f"record_stream({a.stream})")
                return

    def _access(self, t: torch.Tensor, write: bool, op: str, rows: torch.Tensor | None = None,
                allocated: bool = False) -> None:
        stream = self._current
        entry = self._storage(t, allocated)
        if rows is not None and self.scratch_row0 is not None and t.dim() > 0 and self.scratch_row0(t):
            rows = rows[rows.remainder(t.shape[0]) != 0]  # a row of garbage by definition (a dummy KV slot)
        new = _Access(stream.name, stream.clock[stream.name], write, _spans(t, rows), op)
        for old in entry.accesses:
            if (old.write or write) and not self._ordered(old, stream) and _overlap(old.spans, new.spans):
                kind = f"{'write' if old.write else 'read'} -> {'write' if write else 'read'}"
                self.errors.append(f"race ({kind}): {op} on {stream.name} after {old.op} on {old.stream} with no "
                                   f"event between them")
        entry.accesses = [a for a in entry.accesses
                          if not (a.stream == new.stream and a.spans == new.spans and a.write <= write)
                          and not all(self._ordered(a, s) for s in self.streams)]
        entry.accesses.append(new)

    def _record_stream(self, t: torch.Tensor, stream) -> None:
        self._check_stream(stream, "Tensor.record_stream")
        with _disable_current_modes():
            self._storage(t, False).recorded_on.add(stream.name)

    def _on_op(self, func, args, kwargs, out) -> None:
        stream = self._current
        stream.clock[stream.name] += 1
        name = str(func.overloadpacket.__name__)
        self.log.append((name, stream.name))
        if func in _HOST_READS:
            self._host_waits_for(dict(stream.clock))
        if func.is_view:
            return
        schema = func._schema
        inputs: list[tuple[torch.Tensor, bool]] = []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written = arg.alias_info is not None and arg.alias_info.is_write
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    inputs.append((t, written))
        seen = {id(t.untyped_storage()) for t, _ in inputs}
        rows = _index_rows(func, args)
        for pos, (t, written) in enumerate(inputs):
            self._access(t, written, name, rows if pos == 0 else None)
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in seen:
                self._access(t, True, name, allocated=True)

    def __enter__(self) -> CudaStreamDouble:
        if self._modes:
            raise RuntimeError("CudaStreamDouble entered twice: its modes would outlive the outer with")
        self._modes = [_RecordStreamMode(self), _OpMode(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []


def _index_rows(func, args) -> torch.Tensor | None:
    """The dim-0 rows an indexed op reads or writes of its first argument (int64 single index), else None."""
    if func in _ROW_WRITES or func in _ROW_READS:
        indices = args[1]
        if len(indices) == 1 and indices[0] is not None and indices[0].dtype == torch.int64:
            return indices[0]
        return None
    if func in (_aten.index_select.default, _aten.index_copy_.default, _aten.index_copy.default) and args[1] == 0:
        return args[2]
    return None


class _OpMode(TorchDispatchMode):
    def __init__(self, double: CudaStreamDouble):
        super().__init__()
        self.double = double

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        with torch._C.DisableTorchFunction(), _disable_current_modes():  # bookkeeping: seen by no other mode
            self.double._on_op(func, args, kwargs, out)
        return out


class _RecordStreamMode(TorchFunctionMode):
    def __init__(self, double: CudaStreamDouble):
        super().__init__()
        self.double = double

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.record_stream:
            self.double._record_stream(args[0], args[1] if len(args) > 1 else (kwargs or {}).get("stream"))
            return None
        return func(*args, **(kwargs or {}))
