"""HostSyncGuard: prove on CPU that a forward could be captured in a CUDA graph.

A CUDA graph records device work only. Anything in a captured forward that reads a device value on the host
(``.item()``, ``.tolist()``, ``bool(tensor)``, ``int(tensor)``) or whose output shape depends on device values
(``nonzero``, boolean-mask indexing, ``bincount``, ``unique``, ``repeat_interleave`` with tensor repeats,
``masked_select``) either fails capture or bakes one step's values into every replay. On CPU nothing fails, so the
CPU graph runner wraps its capture run in this guard, which raises :class:`HostSyncError` at the first such call.

Two PyTorch extension points see these calls: a ``TorchFunctionMode`` sees Python-level tensor methods (``tolist``
never reaches the dispatcher on CPU), and a ``TorchDispatchMode`` sees the ATen ops the rest lower to
(``_local_scalar_dense`` is what ``item``/``bool``/``int`` run; the data-dependent-shape ops by name).
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


class _SyncFunctionMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = _SYNC_METHODS.get(func)
        if what is not None:
            raise HostSyncError(f"host sync in a graph-captured forward: {what}")
        return func(*args, **(kwargs or {}))


class _SyncDispatchMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _SYNC_OPS.get(func)
        if what is None and func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            what = "repeat_interleave with tensor repeats and no output_size (data-dependent shape)"
        if what is None and func is _aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            what = "boolean-mask indexing (data-dependent shape)"
        if what is not None:
            raise HostSyncError(f"host sync in a graph-captured forward: {what} ({func})")
        return func(*args, **kwargs)


class HostSyncGuard:
    """Context manager raising :class:`HostSyncError` on any host sync or data-dependent shape inside it.

    Example::

        with HostSyncGuard():
            logits = forward(static_batch)   # raises if the forward could not be a CUDA graph
    """

    def __enter__(self) -> HostSyncGuard:
        self._modes = [_SyncFunctionMode(), _SyncDispatchMode()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
