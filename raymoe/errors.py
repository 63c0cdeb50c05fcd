"""Typed errors raised by raymoe.

Every error that a user can cause names the offending field, so that the HTTP layer can turn it into an
OpenAI-style 400 body (``param`` = ``field``) and library users can catch one type.
"""

from __future__ import annotations


class RaymoeError(Exception):
    """Base class of all raymoe errors."""


class InvalidRequestError(RaymoeError, ValueError):
    """A request or option is invalid.

    Attributes:
        field: name of the offending field (``"prompt"``, ``"max_tokens"``, ``"temperature"`` ...).
        message: human readable reason.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):
        # Rebuilt from its fields, so it crosses processes (Ray, Serve handles) as itself, not as an error about it.
        return type(self), (self.field, self.message)


class ContextLengthError(InvalidRequestError):
    """A prompt fills the context: no room is left for an output token (OpenAI's ``context_length_exceeded``)."""


class CheckpointError(RaymoeError):
    """A model folder is missing, unreadable, or does not match the model architecture.

    Attributes:
        path: the folder or file that is at fault.
    """

    def __init__(self, path: str, message: str):
        self.path = str(path)
        self.message = message
        super().__init__(f"{path}: {message}")

    def __reduce__(self):
        return type(self), (self.path, self.message)


class EngineUnhealthyError(RaymoeError, RuntimeError):
    """The engine lost a rank or was shut down; in-flight and new requests fail with this error."""


class PlacementError(RaymoeError, ValueError):
    """The engine's ranks cannot be placed on this cluster as they must be (``raymoe.cluster.rank_plan``: GPU nodes
    of different sizes, a TP group or DeepEP's NVLink domain across nodes, a placement that broke the plan)."""


class BackendUnavailableError(InvalidRequestError, ImportError):
    """An option selects an optional backend whose package is not installed (e.g. ``attention_backend="flash_attn"``
    without ``vllm``). Raised at config time; ``field`` names the option, the message names the package."""


class RequestFailedError(RaymoeError, RuntimeError):
    """One request failed inside the engine (building, computing or post-processing its part of a step) while
    the engine went on serving the others. The message says what failed, never how (no tracebacks)."""

    def __init__(self, message: str):
        self.message = message
        super().__init__(message)
