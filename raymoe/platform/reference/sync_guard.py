"""HostSyncGuard: prove on CPU that a forward could be captured in a CUDA graph.

A CUDA graph records device work only. Anything in a captured forward that reads a device value on the host
(``.item()``, ``.tolist()``, ``bool(tensor)``, ``int(tensor)``) or whose output shape depends on device values
(``nonzero``, boolean-mask indexing, ``bincount``, ``unique``, ``repeat_interleave`` with tensor repeats,
``masked_select``) either fails capture or bakes one step's values into every replay. On CPU nothing fails, so the
CPU graph runner wraps its capture run in this guard, which raises :class:`HostSyncError` at the first such call.

Two PyTorch extension points see these calls: a ``TorchFunctionMode`` sees Python-level tensor methods (``tolist``
never reaches the dispatcher on CPU), and a ``TorchDispatchMode`` sees the ATen ops the rest lower to
(``_local_scalar_dense`` is what ``item``/``bool``/``int`` run; the data-dependent-shape ops by name).

Given the rank's ``device``, the guard also holds a whole step to what a GPU rank needs to launch it without
waiting for the device (``tests/test_decode_host_sync.py``): no ``torch.tensor``/``torch.as_tensor`` of host data
made directly on that device (a blocking host-to-device copy, which ends in ``cudaStreamSynchronize``; use
``raymoe.step.host_transfer.to_device``), and no blocking device-to-host copy (``Tensor.cpu()``, or ``Tensor.to``
the CPU without ``non_blocking=True``). On a CPU rank these calls cost nothing, so only the rule catches them.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class HostSyncError(RuntimeError):
    """A host synchronization or a data-dependent shape inside a forward that must be graph-capturable."""


_SYNC_METHODS = {
    torch.Tensor.tolist: "Tensor.tolist()", torch.Tensor.item: "Tensor.item()", torch.Tensor.__bool__: "bool(tensor)",
    torch.Tensor.__int__: "int(tensor)", torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__index__: "tensor used as a Python index", torch.Tensor.numpy: "Tensor.numpy()",
}

_aten = torch.ops.aten
_SYNC_OPS = {
    _aten._local_scalar_dense.default: "a device value read on the host (item/bool/int)",
    _aten.nonzero.default: "nonzero (data-dependent shape)",
    _aten.masked_select.default: "masked_select (data-dependent shape)",
    _aten.bincount.default: "bincount (data-dependent shape)",
    _aten._unique2.default: "unique (data-dependent shape)",
    _aten.unique_dim.default: "unique (data-dependent shape)",
    _aten.unique_consecutive.default: "unique_consecutive (data-dependent shape)",
    _aten.equal.default: "torch.equal (returns a host bool)",
    _aten.is_nonzero.default: "truth value of a tensor",
}


_FACTORIES_FROM_DATA = {torch.tensor: "torch.tensor", torch.as_tensor: "torch.as_tensor"}


def _where(device: torch.device | None) -> str:
    return "a graph-captured forward" if device is None else f"a step launched on {device.type}"


def _is_host(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _to_host_blocking(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` copies to the CPU without ``non_blocking=True``."""
    targets = [a for a in args[1:] if isinstance(a, (str, torch.device))]
    if "device" in kwargs:
        targets.append(kwargs["device"])
    non_blocking = kwargs.get("non_blocking", any(a is True for a in args[1:] if isinstance(a, bool)))
    return any(_is_host(t) for t in targets) and not non_blocking


class _SyncFunctionMode(TorchFunctionMode):
    def __init__(self, device: torch.device | None):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _SYNC_METHODS.get(func)
        if what is None and self.device is not None:
            what = self._step_rule(func, args, kwargs)
        if what is not None:
            raise HostSyncError(f"host sync in {_where(self.device)}: {what}")
        return func(*args, **kwargs)

    def _step_rule(self, func, args: tuple, kwargs: dict) -> str | None:
        """A call that makes a GPU rank wait for its device (module docstring), or None."""
        factory = _FACTORIES_FROM_DATA.get(func)
        if factory is not None:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == self.device.type and not (
                    args and isinstance(args[0], torch.Tensor)):
                return f"{factory}(host data, device={device!r}): a blocking host-to-device copy (use to_device)"
        if func is torch.Tensor.cpu:
            return "Tensor.cpu(): a blocking device-to-host copy"
        if func is torch.Tensor.to and _to_host_blocking(args, kwargs):
            return "Tensor.to(cpu) without non_blocking=True: a blocking device-to-host copy"
        return None


class _SyncDispatchMode(TorchDispatchMode):
    def __init__(self, device: torch.device | None):
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _SYNC_OPS.get(func)
        if what is None and func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            what = "repeat_interleave with tensor repeats and no output_size (data-dependent shape)"
        if what is None and func is _aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            what = "boolean-mask indexing (data-dependent shape)"
        if what is not None:
            raise HostSyncError(f"host sync in {_where(self.device)}: {what} ({func})")
        return func(*args, **kwargs)


class HostSyncGuard:
    """Context manager raising :class:`HostSyncError` on any host sync or data-dependent shape inside it.

    Args:
        device: the rank's device: also refuse the blocking host<->device copies of a step (module docstring);
            None: only the reads and shapes a CUDA graph cannot hold.

    Example::

        with HostSyncGuard():
            logits = forward(static_batch)   # raises if the forward could not be a CUDA graph
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = None if device is None else torch.device(device)

    def __enter__(self) -> HostSyncGuard:
        self._modes = [_SyncFunctionMode(self.device), _SyncDispatchMode(self.device)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
