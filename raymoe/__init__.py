"""raymoe: a Ray-native serving engine for Mixture-of-Experts LLMs.

``Engine`` and ``RequestOutput`` are imported on first use (PEP 562 ``__getattr__``): importing ``raymoe`` alone
pulls in neither torch nor Ray, so a light process (the HTTP front end's body-parsing workers,
``raymoe.deploy.parse_worker``) can import a ``raymoe`` module without loading the engine.
"""

from raymoe.errors import CheckpointError, EngineUnhealthyError, InvalidRequestError, RaymoeError
from raymoe.scheduler.sampling_params import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams", "CheckpointError", "EngineUnhealthyError",
           "InvalidRequestError", "RaymoeError"]
__version__ = "0.1.0"
_LAZY = ("Engine", "RequestOutput")


def __getattr__(name: str):
    if name in _LAZY:
        from raymoe import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'raymoe' has no attribute {name!r}")
