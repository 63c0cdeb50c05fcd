"""Request and error bodies of the OpenAI-compatible HTTP API (pydantic models; also the OpenAPI schema).

Owned by the front end: ``openai_api`` validates bodies against these models, ``request_prep`` turns them into
token ids and ``SamplingParams``. Responses are built as plain dicts in ``responses`` (cheaper per streamed
chunk); their shape follows the OpenAI API reference. Fields the engine does not support are accepted only at
their neutral value, so a client never gets silently different behaviour (``n`` must be 1, penalties 0); the
schema says so, so generated clients and fuzzers see the same limits.
Unknown fields are ignored, as OpenAI clients send optional extras.

Every field is bounded here (the OpenAPI schema carries the bounds): numbers have ranges and must be finite
(``NaN``/``Infinity`` literals are refused), lists and strings have lengths, strings must be valid Unicode (a
lone surrogate such as ``"\\ud800"`` is refused, it could not be tokenized). Limits an operator configures
(stop-string count and length, the ``timeout`` ceiling) are checked in ``request_prep`` against
``ServerLimits``; the bounds here are the engine-wide caps of ``raymoe.scheduler.sampling_params``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from raymoe.deploy.server_config import MAX_REQUEST_TIMEOUT_S
from raymoe.scheduler.sampling_params import (
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    MAX_TOP_K,
)

# Longest model id, user tag and message name accepted (characters).
MAX_NAME_CHARS = 256
# Most chat messages in one request (the body size bounds their total length).
MAX_MESSAGES = 4096
# Most token ids in a token-id prompt (the context length is checked after tokenization).
MAX_PROMPT_TOKEN_IDS = 1 << 20


def _valid_unicode(s: str) -> str:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode text (no lone surrogates)") from None
    return s


Text = Annotated[str, AfterValidator(_valid_unicode)]
"""A string of valid Unicode (JSON allows escapes of lone surrogates; tokenizers and UTF-8 do not)."""
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS), AfterValidator(_valid_unicode)]
_STRICT = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the ``usage`` (and no choices)."""

    model_config = _STRICT

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Sampling fields shared by completions and chat completions."""

    model_config = _STRICT

    model: Name = Field(description="a model id from /v1/models")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="choices per request; only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="stop strings (cut from the text); the server may allow fewer (see README)")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="same seed and body give the same output")
    presence_penalty: float | None = Field(None, ge=0.0, le=0.0, description="only 0 is supported")
    frequency_penalty: float | None = Field(None, ge=0.0, le=0.0, description="only 0 is supported")
    logit_bias: dict[Name, float] | None = Field(None, description="not supported (must be empty)")
    user: Name | None = None
    # raymoe extensions (sent by OpenAI clients through ``extra_body``).
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K,
                              description="keep the k most likely tokens; -1 or 0 disables it")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=1.0, le=1.0, description="only 1 is supported")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS,
                                                 description="token ids that end generation")
    ignore_eos: bool = Field(False, description="keep generating past the end-of-sequence token")
    timeout: float | None = Field(None, gt=0.0, le=MAX_REQUEST_TIMEOUT_S,
                                  description="deadline in seconds from arrival (default and ceiling: server "
                                              "limits); when it passes the request is aborted: 408, or an "
                                              "error event in a stream")


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: Text | TokenIds | Annotated[list[Text], Field(max_length=1)] | Annotated[
        list[TokenIds], Field(max_length=1)] = Field(
        description="text or token ids; a list of one prompt is accepted, batches are not")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="tokens to generate; default 16")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top log-probabilities per token")
    echo: bool = Field(False, description="not supported (must be false)")
    best_of: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
    suffix: Text | None = Field(None, description="not supported")


class TextPart(BaseModel):
    """A text part of a message ``content`` list."""

    model_config = _STRICT

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """One chat message. ``content`` may be a string or a list of text parts (joined)."""

    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Name | None = None

    def text(self) -> str:
        """The message text (text parts concatenated, ``None`` as empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``; the prompt is the tokenizer's chat template over ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS,
                                   description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS,
                                              description="default: the rest of the context")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = Field(None, description="not supported (must be empty)")


class ErrorInfo(BaseModel):
    """The ``error`` object of an error response; ``request_id`` is also the ``X-Request-Id`` header and the id
    under which the server logged what went wrong."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None
    request_id: str | None = None


class ErrorResponse(BaseModel):
    """Every non-2xx answer: ``{"error": {"message", "type", "param", "code", "request_id"}}``."""

    error: ErrorInfo
