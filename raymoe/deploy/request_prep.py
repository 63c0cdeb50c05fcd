"""From a validated request body to what the engine takes: prompt token ids and ``SamplingParams``.

Applies the tokenizer's chat template (control tokens inside messages are encoded as text, so a user cannot
forge a turn), checks the prompt against the vocabulary and the context length, checks the operator's limits
(``ServerLimits``: stop strings, ``timeout``) and fills the defaults (completions: 16 tokens; chat: the rest of the
context; the deadline: ``default_timeout_s``). An explicit ``max_tokens`` (or ``max_completion_tokens``) that does
not fit beside the prompt is a 400 ``context_length_exceeded`` with both numbers; a default is cut to the room
left. Fields the engine does not have (``echo``, ``n`` > 1 ...) were already refused by the body
parser (``openai_fields``). With ``tools`` the template is shown the tools and the answer is parsed for calls
(``raymoe.deploy.tool_calls``); ``tool_choice`` required or a named function also constrains the answer to calls
(``raymoe.deploy.tool_grammar``), as ``response_format`` json_object / json_schema and the ``regex`` / ``ebnf``
extensions constrain it to their language (a ``GrammarSpec`` in ``SamplingParams.grammar``).

:func:`prepare` is CPU work proportional to the prompt (templating, tokenizing): ``openai_api`` runs it in a
worker thread, never on the event loop, so a huge prompt does not stall other requests' streams. The cheap
checks run before the tokenizer, so a request refused for its options costs no tokenization.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from raymoe.deploy.echo import Echo, echo_of
from raymoe.deploy.harmony import HarmonyChat
from raymoe.deploy.http_errors import APIError
from raymoe.deploy.protocol import ChatCompletionRequest, CompletionRequest
from raymoe.deploy.reasoning import starts_in_reasoning
from raymoe.deploy.server_config import ServerLimits
from raymoe.deploy.tool_grammar import tool_call_grammar
from raymoe.errors import ContextLengthError, InvalidRequestError
from raymoe.scheduler.request_rules import RequestLimits
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.grammar import GrammarSpec

_COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class PreparedRequest:
    """What one HTTP request asks of the engine.

    Attributes:
        prompt_ids: prompt token ids. params: sampling parameters (``max_tokens`` fits the context).
        logprobs: top log-probabilities per token to return (None: none).
        timeout_s: the request's deadline, seconds from its arrival.
        in_reasoning: with a reasoning parser, whether the output starts inside the thinking (the rendered prompt
            left a ``<think>`` open; ``raymoe.deploy.reasoning``); None without one (or for text completions).
        tool_names: the request's tools when the output is parsed for calls (``tools`` with ``tool_choice``
            ``auto``; ``raymoe.deploy.tool_calls``), else None. parallel_tool_calls: False keeps the first call.
        harmony_output: the output is harmony, parsed by ``raymoe.deploy.harmony.HarmonyStream`` (a gpt-oss chat
            without a grammar).
        echo: a completion with ``echo``: the prompt that opens the answer (``raymoe.deploy.echo``), else None.
        prompt_logprobs: the ``prompt_logprobs`` extension's top-k (the answer's ``prompt_logprobs``), else None.
    """

    prompt_ids: list[int]
    params: SamplingParams
    logprobs: int | None
    timeout_s: float
    in_reasoning: bool | None = None
    tool_names: frozenset[str] | None = None
    parallel_tool_calls: bool = True
    harmony_output: bool = False
    echo: Echo | None = None
    prompt_logprobs: int | None = None


def _check_combinations(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Fields that only make sense together (each field alone was checked by the body parser)."""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs is not available with stream=true", param="prompt_logprobs")


def _check_limits(req: CompletionRequest | ChatCompletionRequest, stop: list[str], limits: ServerLimits,
                  vocab_size: int) -> float:
    """The request's deadline (seconds); 400 naming the field past a limit of the operator's."""
    if len(stop) > limits.max_stop_strings:
        raise APIError(400, f"at most {limits.max_stop_strings} stop strings are allowed, got {len(stop)}",
                       param="stop", code="too_many_stop_strings")
    if any(len(s) > limits.max_stop_string_chars for s in stop):
        raise APIError(400, f"stop strings may have at most {limits.max_stop_string_chars} characters",
                       param="stop", code="stop_string_too_long")
    if req.stop_token_ids and max(req.stop_token_ids) >= vocab_size:
        raise APIError(400, f"stop token ids must be in [0, {vocab_size})", param="stop_token_ids")
    if req.timeout is not None and req.timeout > limits.max_timeout_s:
        raise APIError(400, f"timeout may be at most {limits.max_timeout_s} seconds", param="timeout")
    return req.timeout if req.timeout is not None else limits.default_timeout_s


def _completion_prompt(req: CompletionRequest, tokenizer) -> list[int]:
    if isinstance(req.prompt, str):  # a list of one prompt was unwrapped by the schema
        return tokenizer.encode(req.prompt, add_special_tokens=False)
    return list(req.prompt)


# Arguments of ``apply_chat_template`` that ``chat_template_kwargs`` may not set (the server's own).
_TEMPLATE_ARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                            "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                            "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
                            "sanitize_control_tokens"})


def _tool_names(req: ChatCompletionRequest, tool_parser: str | None) -> frozenset[str] | None:
    """The tools whose calls the output is parsed for (None: no tools, or ``tool_choice`` none).

    Raises:
        APIError: 400 for a ``tool_choice`` without tools, two tools of one name, or tools for a model without a
            tool-call parser.
    """
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "two tools have the same function name", param="tools")
    if tool_parser is None:
        raise APIError(400, "this server has no tool-call parser for its model; start it with --tool-call-parser",
                       param="tools", code="unsupported_value")
    # a named function that is not among the tools is refused where its grammar is built (tool_grammar)
    return frozenset(names) if isinstance(choice, str) or choice is None else frozenset((choice.function.name,))


def _forces_a_call(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """``tools`` with ``tool_choice`` required or a named function: the answer must be calls."""
    return bool(getattr(req, "tools", None)) and getattr(req, "tool_choice", None) not in (None, "none", "auto")


def constrained(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether ``req`` asks for an output constraint (its grammar is built and compiled: CPU work of milliseconds
    that the caller keeps off the event loop)."""
    fmt = getattr(req, "response_format", None)
    return (req.regex is not None or req.ebnf is not None or (fmt is not None and fmt.type != "text")
            or _forces_a_call(req))


def _grammar(req: CompletionRequest | ChatCompletionRequest, tool_parser: str | None) -> GrammarSpec | None:
    """The request's output constraint (None: free text): ``response_format`` json_object / json_schema, the
    ``regex`` or ``ebnf`` extension, or a forced tool call (``tool_choice`` required or named, after
    :func:`_tool_names` accepted the tools). Its compilation is checked later (``OpenAIServing``).

    Raises:
        APIError: 400 naming the second of two constraints, or a field whose value cannot be a constraint.
    """
    found: list[GrammarSpec] = []
    try:
        fmt = getattr(req, "response_format", None)
        if fmt is not None and fmt.type == "json_object":
            found.append(GrammarSpec("json_object", field="response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            js = fmt.json_schema
            if js is None:
                raise InvalidRequestError("response_format", "type json_schema needs a json_schema object")
            schema = js.schema_ if js.schema_ is not None else {"type": "object"}
            found.append(GrammarSpec("json_schema", json.dumps(schema), field="response_format",
                                     strict=bool(js.strict)))
        if req.regex is not None:
            found.append(GrammarSpec("regex", req.regex, field="regex"))
        if req.ebnf is not None:
            found.append(GrammarSpec("ebnf", req.ebnf, field="ebnf"))
        if _forces_a_call(req):
            parallel = req.parallel_tool_calls is not False
            found.append(tool_call_grammar(tool_parser, req.tools, req.tool_choice, parallel))
    except InvalidRequestError as e:
        raise APIError(400, e.message, param=e.field, code="invalid_value") from None
    if len(found) > 1:
        raise APIError(400, f"{found[1].field} cannot be combined with {found[0].field}: one output constraint per "
                            "request", param=found[1].field)
    return found[0] if found else None


def _message(m) -> dict:
    """A chat message as the chat template takes it (OpenAI's shape; ``None`` fields left out)."""
    out = {"role": m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _chat_prompt(req: ChatCompletionRequest, tokenizer, with_tools: bool) -> list[int]:
    from jinja2 import TemplateError

    extra = dict(req.chat_template_kwargs or {})
    if taken := sorted(_TEMPLATE_ARGS & set(extra)):
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)} (the server sets it)",
                       param="chat_template_kwargs")
    if with_tools:
        extra["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    messages = [_message(m) for m in req.messages]
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False, sanitize_control_tokens=True, **extra)
    except TemplateError as e:  # a template's raise_exception() refusing the conversation; its text is for users
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise APIError(400, f"the chat template refused the messages: {reason}", param="messages") from e
    return [int(t) for t in ids]


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """``logit_bias`` as token id -> value, its keys parsed as OpenAI writes them (decimal strings).

    Raises:
        APIError: 400 ``logit_bias``, naming a key that is not a token id of the vocabulary.
    """
    out = {}
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise APIError(400, f"logit_bias: {key!r} is not a token id of this model's vocabulary [0, {vocab_size})",
                           param="logit_bias", code="invalid_value")
        out[token] = value
    return out


def _check_prompt(ids: list[int], asked: int | None, vocab_size: int, max_context_len: int, field: str) -> None:
    """The engine's prompt rules and, when the request named its output length ``asked``, the context rule
    (``raymoe.scheduler.request_rules``), answered here as a 400 naming ``field`` before the request reaches the
    engine."""
    rules = RequestLimits(max_context_len, vocab_size)
    try:
        rules.check_prompt(ids, field)
        if asked is not None:
            rules.check_output_room(len(ids), asked, field)
    except InvalidRequestError as e:
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
        raise APIError(400, e.message, param=e.field, code=code) from None


def prepare(req: CompletionRequest | ChatCompletionRequest, tokenizer, vocab_size: int,
            max_context_len: int, limits: ServerLimits, reasoning_parser: str | None = None,
            tool_parser: str | None = None, harmony: HarmonyChat | None = None) -> PreparedRequest:
    """Tokenize and validate ``req`` (blocking CPU work: call it from a worker thread). ``reasoning_parser``
    (``raymoe.deploy.reasoning``): a chat request's output is split into reasoning and answer. ``tool_parser``
    (``raymoe.deploy.tool_calls``): the model family's tool-call format (None: tools are refused). ``harmony``: the
    model chats in harmony (``raymoe.deploy.harmony``: prompts rendered and outputs parsed by openai-harmony).

    Raises:
        APIError: 400 naming the field (empty or too long prompt, prompt + max_tokens over the context, bad sampling
            value, a limit of ``limits`` passed, fields that need each other).
    """
    _check_combinations(req)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    timeout_s = _check_limits(req, stop, limits, vocab_size)
    chat = isinstance(req, ChatCompletionRequest)
    if chat:
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        asked, logprobs = req.max_tokens, req.logprobs
    tool_names = _tool_names(req, tool_parser) if chat else None
    harmony = harmony if chat else None
    if chat:
        _check_harmony(req, harmony)
    grammar = _grammar(req, tool_parser)
    if harmony is not None:
        ids = _harmony_prompt(req, harmony, grammar is not None)
        stop_ids = tuple(dict.fromkeys((*(req.stop_token_ids or ()), *harmony.stop_token_ids)))
    else:
        ids = _chat_prompt(req, tokenizer, tool_names is not None) if chat else _completion_prompt(req, tokenizer)
        stop_ids = tuple(req.stop_token_ids or ())
    echo = None if chat else echo_of(req.echo, req.prompt, ids, asked, tokenizer)
    if echo is not None and echo.score_only:
        asked = 1  # the prefill samples a token anyway; it is dropped (raymoe.deploy.echo)
    _check_prompt(ids, asked, vocab_size, max_context_len, "messages" if chat else "prompt")
    room = max_context_len - len(ids)
    if asked is not None:
        max_tokens = asked  # fits: checked above
    else:
        max_tokens = room if chat else min(_COMPLETION_DEFAULT_MAX_TOKENS, room)
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0, seed=req.seed, stop=tuple(stop), stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos, logprobs=logprobs, grammar=grammar,
            prompt_logprobs=_prompt_scores(logprobs if echo is not None else None, req.prompt_logprobs),
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias, vocab_size), min_tokens=req.min_tokens or 0)
    except InvalidRequestError as e:
        raise APIError(400, e.message, param=e.field, code="invalid_value") from e
    in_reasoning = None
    if chat and reasoning_parser is not None:
        tail = tokenizer.decode(ids[-16:], skip_special_tokens=False)
        in_reasoning = starts_in_reasoning(reasoning_parser, tail)
    return PreparedRequest(ids, params, logprobs, timeout_s, in_reasoning, tool_names,
                           not chat or req.parallel_tool_calls is not False, harmony is not None and grammar is None,
                           echo, req.prompt_logprobs)


def _check_harmony(req: ChatCompletionRequest, harmony: HarmonyChat | None) -> None:
    """What only a harmony chat takes (``reasoning_effort``) and what it does not (forced tool calls).

    Raises:
        APIError: 400 naming ``reasoning_effort`` for a model that is not harmony's; for one that is,
            ``chat_template_kwargs`` (no template renders its prompt) or ``tool_choice`` required or named (the call
            would have to be forced through harmony's special tokens, which the grammar engine does not cover).
    """
    if harmony is None:
        if req.reasoning_effort is not None:
            raise APIError(400, "reasoning_effort is taken by harmony models (gpt-oss) only",
                           param="reasoning_effort", code="unsupported_value")
        return
    if req.chat_template_kwargs:
        raise APIError(400, "chat_template_kwargs has no use for harmony models (gpt-oss): their prompts are rendered "
                            "by openai-harmony, not by a chat template", param="chat_template_kwargs",
                       code="unsupported_value")
    if req.tools and _forces_a_call(req):
        raise APIError(400, "tool_choice required or a named function is not supported for harmony models "
                            "(gpt-oss): use auto", param="tool_choice", code="unsupported_value")


def _prompt_scores(echoed: int | None, asked: int | None) -> int | None:
    """The top-k the engine scores the prompt with: enough for ``echo`` with ``logprobs`` and for the
    ``prompt_logprobs`` extension (each answer keeps its own k), None for neither."""
    wanted = [k for k in (echoed, asked) if k is not None]
    return max(wanted) if wanted else None


def chat_prompt_ids(req: ChatCompletionRequest, tokenizer, harmony: HarmonyChat | None) -> list[int]:
    """The token ids ``req``'s conversation renders to, as :func:`prepare` renders it: harmony for a harmony model,
    else the chat template (with ``req.tools`` when given and ``tool_choice`` is not none).

    Raises:
        APIError: 400 naming the field the template or harmony refused.
    """
    if harmony is not None:
        return _harmony_prompt(req, harmony, False)
    return _chat_prompt(req, tokenizer, bool(req.tools) and req.tool_choice != "none")


def _harmony_prompt(req: ChatCompletionRequest, harmony: HarmonyChat, constrained: bool) -> list[int]:
    """The harmony rendering of ``req`` (``HarmonyChat.render``); its refusals as 400s naming the field."""
    try:
        return harmony.render(req, constrained)
    except ValueError as e:
        field = "reasoning_effort" if "reasoning_effort" in str(e) else "messages"
        raise APIError(400, str(e), param=field) from None
