"""The two ways a step can fail on the ranks, told apart so that the driver restarts ranks only for rank faults.

* :class:`RankFailure` (an ``EngineUnhealthyError``): a rank process died, a step ran past its bound, or a
  collective failed. The rank group must be restarted.
* :class:`RankStepError`: a rank raised an ordinary exception while computing the step and is still alive
  (a bad row that validation missed). The driver fails that step's requests and keeps the ranks when the
  executor's ``ranks_alive()`` shows none is stuck.
"""

from __future__ import annotations

from raymoe.errors import EngineUnhealthyError, RaymoeError

# Exception type names (a rank's exception, by name) that mean its collectives are broken; see also
# is_collective_error.
COLLECTIVE_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")


class RankFailure(EngineUnhealthyError):
    """A rank died, a step exceeded its bound, or a collective failed: the rank group must be restarted."""


class RankStepError(RaymoeError):
    """A rank raised an ordinary exception in a step and is still alive (its collectives may be intact)."""


def is_collective_error(type_name: str) -> bool:
    """Whether a rank exception of this type name means the rank group's collectives are broken: a
    ``torch.distributed`` error, or ``TimeoutError`` (the shared-memory all-to-all waited a whole collective
    timeout for a peer, ``raymoe.platform.cpu.shm``)."""
    return any(c in type_name for c in COLLECTIVE_ERRORS) or type_name == "TimeoutError"
