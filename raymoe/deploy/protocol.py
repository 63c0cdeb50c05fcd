"""Request and error bodies of the OpenAI-compatible HTTP API (pydantic models; also the OpenAPI schema).

Owned by the front end: ``openai_api`` validates bodies against these models, ``request_prep`` turns them into
token ids and ``SamplingParams``. Responses are built as plain dicts in ``responses`` (cheaper per streamed
chunk); their shape follows the OpenAI API reference. Fields the engine does not support are accepted only at
their neutral value, so a client never gets silently different behaviour (``best_of`` must be 1); the
schema says so, so generated clients and fuzzers see the same limits.
Every field of the OpenAI API is honoured, accepted only at its neutral value, or refused with a 400 naming it
(``openai_fields``, applied by the body parser before these models run); other unknown fields are ignored, as
OpenAI clients send optional extras.

Every field is bounded here (the OpenAPI schema carries the bounds): numbers have ranges and must be finite
(``NaN``/``Infinity`` literals are refused), lists and strings have lengths, strings must be valid Unicode (a
lone surrogate such as ``"\\ud800"`` is refused, it could not be tokenized), token ids are JSON integers (not
``true``, not ``1.0``) and an error about one names its position and why. Limits an operator configures are
checked elsewhere: the structural ones (messages, content parts, token ids, ``logit_bias`` entries, nesting)
while the body is parsed (``body_parse``), stop strings and the ``timeout`` ceiling in ``request_prep``; the
bounds here are the caps those limits may not pass (``body_limits``, ``raymoe.scheduler.sampling_params``).
These models are validated in the body parser, often in a parse worker process: this module imports nothing
heavy.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, Strict, WithJsonSchema
from pydantic_core import PydanticCustomError

from raymoe.deploy.body_limits import (
    CAP_LOGIT_BIAS,
    CAP_MESSAGE_PARTS,
    CAP_MESSAGES,
    CAP_PROMPT_TOKEN_IDS,
    MAX_BATCH_PROMPTS,
)
from raymoe.scheduler.sampling_params import (
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    MAX_TOP_K,
)
from raymoe.step.grammar import MAX_GRAMMAR_CHARS

# Longest model id, user tag and message name accepted (characters).
MAX_NAME_CHARS = 256
# Longest per-request deadline a client may ask for (``timeout`` field), seconds; also ServerLimits' bound.
MAX_REQUEST_TIMEOUT_S = 86_400.0


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
TokenId = Annotated[int, Strict(), Field(ge=0, le=MAX_TOKEN_ID)]
"""A token id: a JSON integer in [0, ``MAX_TOKEN_ID``] (``true`` and ``1.0`` are refused)."""


def _token_id_error(ids: list, where: str) -> PydanticCustomError | None:
    """The error for the first id of ``ids`` that is not a token id (``None``: all are). O(len(ids))."""
    if all(type(t) is int for t in ids) and (not ids or 0 <= min(ids) and max(ids) <= MAX_TOKEN_ID):
        return None
    for i, t in enumerate(ids):
        if type(t) is not int:
            kind = {bool: "a boolean", float: "a number with a fraction or exponent", str: "a string",
                    list: "a list", dict: "an object"}.get(type(t), "null")
            return PydanticCustomError("token_id", "{where}[{i}] is {kind}: token ids are JSON integers",
                                       {"where": where, "i": i, "kind": kind})
        if not 0 <= t <= MAX_TOKEN_ID:
            why = "negative" if t < 0 else f"larger than {MAX_TOKEN_ID}"
            return PydanticCustomError("token_id", "{where}[{i}] is {t}, {why}: token ids are in [0, {max}]",
                                       {"where": where, "i": i, "t": t, "why": why, "max": MAX_TOKEN_ID})
    return None


class PromptBatch(tuple):
    """A completion request's batch of two or more prompts (each text or token ids), in order."""


def _one_prompt(value: Any, where: str) -> str | list[int]:
    if isinstance(value, str):
        return _valid_unicode(value)
    if not isinstance(value, list) or (value and isinstance(value[0], (str, list))):
        raise PydanticCustomError("prompt", "{where} must be a string or a list of token ids", {"where": where})
    if not value:
        raise PydanticCustomError("prompt", "{where} is empty", {"where": where})
    if len(value) > CAP_PROMPT_TOKEN_IDS:
        raise PydanticCustomError("prompt", "at most {n} token ids per prompt", {"n": CAP_PROMPT_TOKEN_IDS})
    if (error := _token_id_error(value, where)) is not None:
        raise error
    return value


def _prompt(value: Any) -> str | list[int] | PromptBatch:
    """A completion prompt: text, token ids, or a list of them (a list of one is unwrapped; two or more are a
    :class:`PromptBatch`). Errors name the prompt and the position of a bad token id, and what is wrong with it."""
    if isinstance(value, str):
        return _valid_unicode(value)
    if not isinstance(value, list):
        raise PydanticCustomError("prompt", "must be a string, a list of token ids, or a list of them")
    if not value:
        raise PydanticCustomError("prompt", "the prompt is empty")
    if not isinstance(value[0], (str, list)):
        return _one_prompt(value, "prompt")
    if len(value) > MAX_BATCH_PROMPTS:
        raise PydanticCustomError("prompt", "at most {n} prompts per request", {"n": MAX_BATCH_PROMPTS})
    if len({isinstance(p, str) for p in value}) > 1:
        raise PydanticCustomError("prompt", "a batch of prompts is all strings or all lists of token ids")
    prompts = [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(value)]
    return prompts[0] if len(prompts) == 1 else PromptBatch(prompts)


_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
                     "minItems": 1, "maxItems": CAP_PROMPT_TOKEN_IDS}
Prompt = Annotated[str | list[int] | PromptBatch, PlainValidator(_prompt), WithJsonSchema({"anyOf": [
    {"type": "string"}, _TOKEN_IDS_SCHEMA,
    {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_BATCH_PROMPTS},
    {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1, "maxItems": MAX_BATCH_PROMPTS}]})]
"""``prompt`` of a completion: validated to text or token ids (a list of one prompt is unwrapped), or a
:class:`PromptBatch` of them."""
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS), AfterValidator(_valid_unicode)]
_STRICT = ConfigDict(extra="ignore", allow_inf_nan=False)

MAX_N = 128
"""Most choices per request (``n``, OpenAI's bound; ``raymoe.deploy.choices``)."""


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
    n: int | None = Field(1, ge=1, le=MAX_N, description="choices per request (each its own generation; a seed "
                                                          "gives each choice its own derived seed)")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="stop strings (cut from the text); the server may allow fewer (see README)")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="same seed and body give the same output")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0,
                                           description="subtracted from the logit of every token the output holds")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0,
                                            description="subtracted once per occurrence of a token in the output")
    logit_bias: Annotated[dict[Name, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=CAP_LOGIT_BIAS)] | None = Field(
        None, description="token id (as a string) -> value in [-100, 100] added to its logit at every step")
    user: Name | None = None
    # raymoe extensions (sent by OpenAI clients through ``extra_body``).
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K,
                              description="keep the k most likely tokens; -1 or 0 disables it")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY,
                                             description="HF's: logits of prompt and output tokens divided by it "
                                                         "where positive, multiplied where negative; 1 is off")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS,
                                                 description="token ids that end generation")
    ignore_eos: bool = Field(False, description="keep generating past the end-of-sequence token")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                        description="vLLM's: each prompt token's log-probability, rank and the top "
                                                    "k there, in prompt_logprobs (not with stream)")
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS,
                                   description="no stop token or stop string ends the output before this many tokens")
    regex: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = Field(
        None, description="the output must match this regular expression (grammar-constrained decoding)")
    ebnf: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = Field(
        None, description="the output must follow this EBNF grammar (xgrammar's dialect, start rule root)")
    timeout: float | None = Field(None, gt=0.0, le=MAX_REQUEST_TIMEOUT_S,
                                  description="deadline in seconds from arrival (default and ceiling: server "
                                              "limits); when it passes the request is aborted: 408, or an "
                                              "error event in a stream")


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: Prompt = Field(description="text or token ids, or a list of them (a batch: each prompt answers n "
                                       "choices, indexed prompt * n + choice)")
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS, description="tokens to generate; default 16; 0 only "
                                                                         "with echo (the prompt is scored)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top log-probabilities per token")
    echo: bool | None = Field(False, description="the answer repeats the prompt first (with logprobs: each prompt "
                                                 "token's log-probability, the first null)")
    best_of: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
    suffix: Text | None = Field(None, description="not supported")


class TextPart(BaseModel):
    """A text part of a message ``content`` list."""

    model_config = _STRICT

    type: Literal["text"]
    text: Text


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
"""A tool's function name, as OpenAI allows it (letters, digits, ``_`` and ``-``, at most 64)."""
MAX_TOOLS = 128


class FunctionDef(BaseModel):
    """A tool's function: its name, what it does, its parameters' JSON schema."""

    model_config = _STRICT

    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    """One entry of ``tools``."""

    model_config = _STRICT

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT

    name: FunctionName


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function."""

    model_config = _STRICT

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the answer must be valid under (any JSON object without one)."""

    model_config = _STRICT

    name: FunctionName
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="true: properties the schema does not list are refused (the "
                                                  "schema is enforced either way)")


class ResponseFormat(BaseModel):
    """``response_format``: free text, any JSON object, or JSON valid under a schema (enforced by
    grammar-constrained decoding, ``raymoe.runner.grammar``)."""

    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionCall(BaseModel):
    """The function of an earlier assistant turn's call: its name and its arguments as JSON text."""

    model_config = _STRICT

    name: FunctionName
    arguments: Text


class MessageToolCall(BaseModel):
    """A call in an earlier assistant turn (``messages[i].tool_calls``)."""

    model_config = _STRICT

    id: Name
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    """One chat message. ``content`` may be a string or a list of text parts (joined); an assistant turn may carry
    its ``tool_calls``, a ``tool`` turn the ``tool_call_id`` it answers (both passed to the chat template)."""

    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=CAP_MESSAGE_PARTS)] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Name | None = None

    def text(self) -> str:
        """The message text (text parts concatenated, ``None`` as empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``; the prompt is the tokenizer's chat template over ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=CAP_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS,
                                   description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS,
                                              description="default: the rest of the context")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="functions the model may call (shown to it through the chat template)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none; auto (the default with tools): the model decides; required or a named function: "
                          "the answer is one or more calls whose arguments follow the tools' schemas (grammar)")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object or json_schema (enforced by grammar-constrained decoding)")
    parallel_tool_calls: bool | None = Field(None, description="false keeps only the first call of an answer")
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None, description="harmony models (gpt-oss): how much the model reasons, stated in its system message")
    # raymoe extension (``extra_body``), as vLLM and SGLang name it.
    chat_template_kwargs: Annotated[dict[Name, bool | int | float | Name | None],
                                    Field(max_length=16)] | None = Field(
        None, description="extra variables for the chat template, e.g. {\"enable_thinking\": false}")


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
