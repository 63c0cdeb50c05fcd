"""raymoe: a Ray-native serving engine for Mixture-of-Experts LLMs."""

from raymoe.engine import Engine, RequestOutput
from raymoe.errors import CheckpointError, EngineUnhealthyError, InvalidRequestError, RaymoeError
from raymoe.scheduler.sampling_params import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams", "CheckpointError", "EngineUnhealthyError",
           "InvalidRequestError", "RaymoeError"]
__version__ = "0.1.0"
