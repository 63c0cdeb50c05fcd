"""CUDA-graph semantics for the DeepEP double (``deep_ep_double``): what a capture records and a replay runs.

On a GPU, a captured graph holds the device kernels launched while it was captured, and a replay runs exactly
those: no host code runs, so a library call that Python makes before or during a replay (a
``clean_low_latency_buffer`` after a normal-mode step, say) happens only if the capture made it too. DeepEP's
normal-mode dispatch cannot be captured at all (the host waits for the received counts), its low-latency kernels
can, but a replay reuses the low-latency buffer of each kernel as captured ("you may restore some buffer status
once you replay", ``deep_ep/buffer.py``).

raymoe's CPU "graphs" re-run the Python forward, so the double is told where a capture and a replay begin and end
(:func:`record_graphs` wraps ``RecordingCapture``). Inside a capture every library call (:func:`library_call`)
is recorded with the low-latency buffer it uses, and runs outside raymoe's ``HostSyncGuard`` (the double computes
on the host what the real kernels do on the device); a call the real library cannot capture raises. Inside a
replay the calls must be the captured ones, in order, on the same buffers, or the GPU would run something else
than the CPU test saw: that raises :class:`~deep_ep_double_core.DoubleMisuse`.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from deep_ep_double_core import misuse

_STATE = threading.local()  # .graph: None, or [mode ("capture" | "replay"), calls, next index]
_RECORDED: dict[int, list[str]] = {}  # graph key -> the library calls its capture made


def _guard_active() -> bool:
    from raymoe.platform.reference.sync_guard import _SyncFunctionMode

    return any(isinstance(m, _SyncFunctionMode) for m in torch.overrides._get_current_function_mode_stack())


@contextlib.contextmanager
def _outside_guard():
    """Run without the torch function and dispatch modes (HostSyncGuard's): the double's host work stands for
    device kernels, which a graph holds."""
    popped = []
    while torch._C._len_torch_function_stack() > 0:
        popped.append(torch._C._pop_torch_function_stack())
    try:
        with torch.utils._python_dispatch._disable_current_modes():
            yield
    finally:
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)


def _note(name: str, capturable: bool) -> None:
    graph = getattr(_STATE, "graph", None)
    if graph is None:
        return
    mode, calls, i = graph
    if mode == "capture":
        if not capturable:
            raise misuse(f"{name} cannot be captured in a CUDA graph (the host waits for the received counts)")
        calls.append(name)
        return
    expected = calls[i] if i < len(calls) else "nothing more"
    if name != expected:
        raise misuse(f"a graph replay calls {name} where its capture called {expected}: on a GPU the replay runs "
                     "only the captured kernels (a host-side call before or inside a replay is not in the graph)")
    graph[2] = i + 1


def library_call(name: str, capturable: bool = True, low_latency: bool = False):
    """Decorate a ``Buffer`` method that launches DeepEP kernels: record or check it against the graph being
    captured or replayed (``low_latency``: with the low-latency buffer it uses), and run it outside HostSyncGuard.

    Raises:
        DoubleMisuse: a call the real library cannot capture, or a replay that differs from its capture.
    """
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            _note(f"{name}@buffer{self._ll_next}" if low_latency else name, capturable)
            if not _guard_active():
                return method(self, *args, **kwargs)
            with _outside_guard():
                return method(self, *args, **kwargs)
        return call
    return wrap


def receive_call(fn):
    """A low-latency hook or an event's wait: device work too, run outside HostSyncGuard."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not _guard_active():
            return fn(*args, **kwargs)
        with _outside_guard():
            return fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def graph_section(mode: str, key: int):
    """The library calls inside are graph ``key``'s capture (``mode`` "capture": recorded) or one of its replays
    ("replay": checked against the capture, and all of them must come).

    Raises:
        DoubleMisuse: nested sections, a replay with other calls than its capture, or fewer.
    """
    if getattr(_STATE, "graph", None) is not None:
        raise misuse("a graph capture or replay inside another one")
    calls = _RECORDED.setdefault(key, []) if mode == "capture" else _RECORDED[key]
    if mode == "capture":
        calls.clear()
    _STATE.graph = [mode, calls, 0]
    try:
        yield
        if mode == "replay" and _STATE.graph[2] != len(calls):
            raise misuse(f"a graph replay made {_STATE.graph[2]} of the {len(calls)} library calls its capture made")
    finally:
        _STATE.graph = None


class _CheckedStep:
    """A recorded step whose replays are checked against its capture."""

    def __init__(self, step, key: int):
        self.step, self.key = step, key

    def replay(self) -> torch.Tensor:
        with graph_section("replay", self.key):
            return self.step.replay()


@contextlib.contextmanager
def record_graphs():
    """While inside, raymoe's CPU graph captures (``RecordingCapture.capture``) record the DeepEP calls of their
    run, and their replays are checked against them (this process only)."""
    from raymoe.platform.reference.graphs import RecordingCapture

    original = RecordingCapture.capture

    def capture(self, run, bs: int, max_bs: int, host_sync_free: bool):
        key = len(_RECORDED)
        with graph_section("capture", key):
            step = original(self, run, bs, max_bs, host_sync_free)
        return _CheckedStep(step, key)

    RecordingCapture.capture = capture
    try:
        yield
    finally:
        RecordingCapture.capture = original
