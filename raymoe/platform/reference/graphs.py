"""Decode "graphs" without a graph API (CPU, and any device in tests): each bucket is a recording of its eager
forward, a callable bound to the bucket's static batch, and a replay runs it again.

What a CUDA graph proves at capture time, a recording proves in a run under
:class:`~raymoe.platform.reference.sync_guard.HostSyncGuard` where the forward must be free of host syncs (the
low-latency dispatch): any read of a device value on the host raises. A replay narrows attention to the step's
longest sequence by itself, so one recording per bucket serves every KV width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from raymoe.platform.reference.sync_guard import HostSyncGuard


class RecordedStep:
    """One bucket's forward, replayed by calling it again."""

    def __init__(self, run: Callable[[], torch.Tensor | tuple[torch.Tensor, ...]]):
        self.run = run

    def replay(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """What the bucket's forward returns over its static batch (logits [bs, V] float32, or a tuple)."""
        return self.run()


class RecordingCapture:
    """:class:`~raymoe.platform.interface.GraphCapture` by recording (module docstring)."""

    fixed_kv_width = False
    binds_addresses = False

    def capture(self, run: Callable[[], torch.Tensor | tuple[torch.Tensor, ...]], bs: int, max_bs: int,
                host_sync_free: bool) -> RecordedStep:
        """Run the bucket once (which also compiles it under ``torch.compile``), under the host-sync guard when
        ``host_sync_free``.

        Raises:
            RuntimeError: the forward read a device value on the host while ``host_sync_free``.
        """
        if host_sync_free:
            with HostSyncGuard():
                run()
        else:
            run()
        return RecordedStep(run)

    def finish(self) -> None:
        """Nothing to wait for."""
