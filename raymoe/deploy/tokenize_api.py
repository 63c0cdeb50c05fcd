"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer over HTTP (vLLM's and SGLang's routes).

A client counts a prompt's tokens before sending it, or reads token ids back as text, with the server's own
tokenizer and chat template: ``/tokenize`` takes a ``prompt`` (text, tokenized as ``/v1/completions`` does:
no special tokens unless ``add_special_tokens``) or ``messages`` (rendered as ``/v1/chat/completions`` renders
them: the chat template with the generation prompt, or harmony for gpt-oss) and answers ``count``, ``tokens``,
``max_model_len`` and, with ``return_token_strs``, each token's text; ``/detokenize`` takes ``tokens`` and answers
``prompt``. Both need the API key like ``/v1/*`` (``raymoe.deploy.http_guard``), read the body within the
server's size limit, and do their CPU work off the event loop.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, ValidationError

from raymoe.deploy.body_limits import CAP_MESSAGES, CAP_PROMPT_TOKEN_IDS
from raymoe.deploy.body_parse import schema_refusal
from raymoe.deploy.harmony import HarmonyChat
from raymoe.deploy.http_errors import APIError, model_not_found
from raymoe.deploy.protocol import _STRICT, ChatCompletionRequest, ChatMessage, Name, Text, TokenId, ToolDef
from raymoe.deploy.request_prep import chat_prompt_ids


class TokenizeRequest(BaseModel):
    """Body of ``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model_config = _STRICT

    model: Name = Field(description="a model id from /v1/models")
    prompt: Text | None = Field(None, description="text, tokenized as /v1/completions does")
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=CAP_MESSAGES)] | None = Field(
        None, description="a conversation, rendered as /v1/chat/completions does")
    tools: list[ToolDef] | None = Field(None, description="with messages: shown to the chat template")
    chat_template_kwargs: dict[Name, bool | int | float | Name | None] | None = None
    add_special_tokens: bool = Field(False, description="with prompt: add the tokenizer's special tokens (BOS)")
    return_token_strs: bool = Field(False, description="also answer each token's text")


class DetokenizeRequest(BaseModel):
    """Body of ``POST /detokenize``."""

    model_config = _STRICT

    model: Name = Field(description="a model id from /v1/models")
    tokens: Annotated[list[TokenId], Field(max_length=CAP_PROMPT_TOKEN_IDS)]


def _parse(model: type[BaseModel], body: bytes, served: str) -> BaseModel:
    """``body`` validated as ``model``, naming the request's served model.

    Raises:
        APIError: 400 naming the field of the first schema error (``body_parse.schema_refusal``, as the completion
            routes word it), 404 for another model.
    """
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        r = schema_refusal(e)
        raise APIError(r.status, r.message, param=r.param, code=r.code) from None
    if req.model != served:
        raise model_not_found(req.model, served)
    return req


def tokenize(body: bytes, tokenizer, served: str, max_context_len: int, harmony: HarmonyChat | None) -> dict:
    """The answer of ``POST /tokenize`` (blocking: run it in a worker thread).

    Raises:
        APIError: 400 naming the field (a schema error, both or neither of ``prompt`` and ``messages``, a template
            refusal), 404 for another model.
    """
    req = _parse(TokenizeRequest, body, served)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        chat = ChatCompletionRequest(model=req.model, messages=req.messages, tools=req.tools,
                                     chat_template_kwargs=req.chat_template_kwargs)
        ids = chat_prompt_ids(chat, tokenizer, harmony)
    ids = [int(t) for t in ids]
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_context_len, "tokens": ids, "token_strs": strs}


def detokenize(body: bytes, tokenizer, served: str, vocab_size: int) -> dict:
    """The answer of ``POST /detokenize`` (blocking: run it in a worker thread).

    Raises:
        APIError: 400 naming ``tokens`` (not token ids, or one outside the vocabulary), 404 for another model.
    """
    req = _parse(DetokenizeRequest, body, served)
    bad = next((i for i, t in enumerate(req.tokens) if t >= vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens[{bad}] is {req.tokens[bad]}, outside the vocabulary [0, {vocab_size})",
                       param="tokens")
    return {"prompt": tokenizer.decode(req.tokens)}

