"""Request and error bodies of the OpenAI-compatible HTTP API (pydantic models; also the OpenAPI schema).

Owned by the front end: ``openai_api`` validates bodies against these models, ``request_prep`` turns them into
token ids and ``SamplingParams``. Responses are built as plain dicts in ``responses`` (cheaper per streamed
chunk); their shape follows the OpenAI API reference. Fields the engine does not support are accepted only at
their neutral value, so a client never gets silently different behaviour (``n`` must be 1, penalties 0); the
schema says so, so generated clients and fuzzers see the same limits.
Unknown fields are ignored, as OpenAI clients send optional extras.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from raymoe.scheduler.sampling_params import MAX_TOP_K

# Largest seed accepted: the samplers seed a torch.Generator, which takes a signed 64-bit value.
MAX_SEED = 2**63 - 1
# Largest number of top log-probabilities a request may ask for per token.
MAX_LOGPROBS = 20

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the ``usage`` (and no choices)."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Sampling fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="a model id from /v1/models")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="choices per request; only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description="stop strings (cut from the text)")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="same seed and body give the same output")
    presence_penalty: float | None = Field(None, ge=0.0, le=0.0, description="only 0 is supported")
    frequency_penalty: float | None = Field(None, ge=0.0, le=0.0, description="only 0 is supported")
    logit_bias: dict[str, float] | None = Field(None, description="not supported (must be empty)")
    user: str | None = None
    # raymoe extensions (sent by OpenAI clients through ``extra_body``).
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K,
                              description="keep the k most likely tokens; -1 or 0 disables it")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    ignore_eos: bool = Field(False, description="keep generating past the end-of-sequence token")


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: str | TokenIds | list[str] | list[TokenIds] = Field(
        description="text or token ids; a list of one prompt is accepted, batches are not")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate; default 16")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top log-probabilities per token")
    echo: bool = Field(False, description="not supported (must be false)")
    best_of: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
    suffix: str | None = Field(None, description="not supported")


class TextPart(BaseModel):
    """A text part of a message ``content`` list."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message. ``content`` may be a string or a list of text parts (joined)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message text (text parts concatenated, ``None`` as empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``; the prompt is the tokenizer's chat template over ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = Field(None, description="not supported (must be empty)")


class ErrorInfo(BaseModel):
    """The ``error`` object of an error response."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every non-2xx answer: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo
