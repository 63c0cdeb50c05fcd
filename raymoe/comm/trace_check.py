"""Agreement before every collective: ranks compare their next call through a key-value store, so a disagreement is
raised on every rank involved *before* the collective that would hang (or pair the wrong buffers) runs.

How: a :class:`StoreCheck` is the ``check`` of a rank's :class:`~raymoe.comm.trace.CollectiveRecorder`. Before the
recorder lets call ``i`` of group ``g`` run, the rank writes that call's :meth:`~raymoe.comm.trace.CollectiveCall.key`
under ``<prefix>/<step>/<g>/<i>/<rank>``, waits for the same key of every other member of ``g`` and compares. At the
end of a step it writes :data:`~raymoe.comm.trace.END_OF_STEP` at the next index of each group, so a rank that
issues a call its peers skip meets their end marker instead of a collective nobody joins. Every rank of the group
sees the same pair of values at the first differing index and raises
:class:`~raymoe.comm.trace.CollectiveMismatch` there. A peer that never writes the key (it is blocked elsewhere,
dead, or in another group's collective first) makes the wait time out: the error then names that peer and the call
it last announced (``<prefix>/last/<rank>``).

On a GPU cluster: the store is the world's rendezvous store (the ``TCPStore`` that ``init_process_group`` used,
:func:`default_store`), which lives on the host and never goes through NCCL, so a check cannot itself deadlock on
the communicator it guards. Each collective then costs a store write and a wait for the peers' keys (a network
round trip or two per peer, host-synchronous): a debugging mode for a few steps, not for serving. CUDA-graph
replays issue no Python calls, so their collectives are checked when the graphs are captured (the capture runs the
same op lists under the recorder). DeepEP's buffers do not go through the EP transport: record them at the
dispatcher if they need checking. Keys of step ``s`` are deleted at the end of step ``s + 1``, when every peer has
read them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from raymoe.comm.trace import END_OF_STEP, CollectiveCall, CollectiveMismatch, CollectiveRecorder

DEFAULT_TIMEOUT_S = 60.0


def default_store(prefix: str = "raymoe/trace") -> Any:
    """The world's rendezvous store under ``prefix`` (a ``torch.distributed.PrefixStore``).

    Raises:
        RuntimeError: the default process group is not initialized.
    """
    return dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())


class StoreCheck:
    """Pre-call agreement of a rank's collectives through ``store`` (see the module docstring).

    Args:
        store: a ``torch.distributed.Store`` every rank of the world shares (``TCPStore``, ``FileStore``,
            ``PrefixStore``, :func:`default_store`); ``set``, ``get``, ``wait``, ``check`` and ``delete_key``.
        timeout_s: how long to wait for a peer's key before naming it, seconds.
        prefix: key prefix (one per run of ranks that share a store).
    """

    def __init__(self, store: Any, timeout_s: float = DEFAULT_TIMEOUT_S, prefix: str = "check"):
        self.store = store
        self.timeout = timedelta(seconds=timeout_s)
        self.prefix = prefix
        self._own_keys: dict[int, list[str]] = {}

    def before(self, recorder: CollectiveRecorder, call: CollectiveCall, index: int) -> None:
        """Announce ``call`` (the ``index``-th of its group this step) and compare it with the peers' calls.

        Raises:
            CollectiveMismatch: a peer announced another call or its end of step, or never announced one.
        """
        self._set(recorder, f"{self.prefix}/last/{recorder.rank}",
                  f"step {recorder.step} {call.group} #{index}: {call}", keep=True)
        self._agree(recorder, call.group, index, repr(call.key()), str(call))

    def end_step(self, recorder: CollectiveRecorder, counts: Mapping[str, int]) -> None:
        """Announce the end of the step in every group of the rank and check the peers end there too; then delete
        this rank's keys of the step before (every peer has read them).

        Raises:
            CollectiveMismatch: a peer issues another call where this rank ends its step.
        """
        self._set(recorder, f"{self.prefix}/last/{recorder.rank}", f"step {recorder.step}: {END_OF_STEP}", keep=True)
        for group, members in recorder.members.items():
            if len(members) > 1 and group != "other":
                self._agree(recorder, group, counts.get(group, 0), END_OF_STEP, END_OF_STEP)
        for key in self._own_keys.pop(recorder.step - 1, []):
            self.store.delete_key(key)

    def _set(self, recorder: CollectiveRecorder, key: str, value: str, keep: bool = False) -> None:
        self.store.set(key, value)
        if not keep:
            self._own_keys.setdefault(recorder.step, []).append(key)

    def _agree(self, recorder: CollectiveRecorder, group: str, index: int, key: str, text: str) -> None:
        base = f"{self.prefix}/{recorder.step}/{group}/{index}"
        self._set(recorder, f"{base}/{recorder.rank}", json.dumps([key, text]))
        peers = [p for p in recorder.members[group] if p != recorder.rank]
        self._wait(recorder, group, index, base, peers, text)
        for p in peers:
            their_key, their_text = json.loads(self.store.get(f"{base}/{p}"))
            if their_key != key:
                raise CollectiveMismatch(recorder.step, group, index, recorder.rank, text, p, their_text)

    def _wait(self, recorder: CollectiveRecorder, group: str, index: int, base: str, peers: Sequence[int],
              text: str) -> None:
        try:
            self.store.wait([f"{base}/{p}" for p in peers], self.timeout)
        except RuntimeError as e:  # DistStoreError on a timeout
            missing = [p for p in peers if not self.store.check([f"{base}/{p}"])]
            if not missing:
                raise
            p = missing[0]
            last_key = f"{self.prefix}/last/{p}"
            last = self.store.get(last_key).decode() if self.store.check([last_key]) else "nothing"
            raise CollectiveMismatch(recorder.step, group, index, recorder.rank, text, p,
                                     f"nothing within {self.timeout.total_seconds():g} s (its last announced call: "
                                     f"{last})") from e
