"""OpenAI response bodies and stream chunks for completions and chat completions (plain dicts).

A :class:`ResponseBuilder` is made per request; it turns :class:`~raymoe.deploy.generation.Piece` records into
non-streamed answers (``complete``) or streamed chunks (``chunk``, ``usage_chunk``). Shapes follow the OpenAI API
reference: ``text_completion`` / ``chat.completion`` objects, ``usage`` with cached prompt tokens, completion
logprobs as ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset`` and chat logprobs as ``content``.
"""

from __future__ import annotations

import json
import time
import uuid

from raymoe.deploy.generation import Piece
from raymoe.step.step_output import TokenLogprobs


def sse(payload: dict | str) -> str:
    """One server-sent event (``data: ...`` and a blank line)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def usage_dict(piece: Piece) -> dict:
    """The ``usage`` object from a request's last piece."""
    return {"prompt_tokens": piece.prompt_tokens, "completion_tokens": piece.completion_tokens,
            "total_tokens": piece.prompt_tokens + piece.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": piece.cached_tokens}}


class ResponseBuilder:
    """Builds the answers of one request.

    Args:
        chat: chat completion (else text completion). model: the served model name. tokenizer: for token strings
            in logprobs. top_logprobs: alternatives asked per token (None: no logprobs).
    """

    def __init__(self, chat: bool, model: str, tokenizer, top_logprobs: int | None):
        self.chat = chat
        self.model = model
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._text_offset = 0

    def _header(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(self, piece: Piece) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp in zip(piece.token_ids, piece.logprobs, strict=False):
            tok = self._token(tid)
            out["tokens"].append(tok)
            out["token_logprobs"].append(lp.logprob if lp else None)
            out["top_logprobs"].append({self._token(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs,
                                                                          strict=False)} if lp else None)
            out["text_offset"].append(self._text_offset)
            self._text_offset += len(tok)
        return out

    def _chat_entry(self, token_id: int, lp: TokenLogprobs | None) -> dict:
        tok = self._token(token_id)
        top = [] if lp is None else [
            {"token": self._token(t), "logprob": v, "bytes": list(self._token(t).encode())}
            for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=False)]
        return {"token": tok, "logprob": lp.logprob if lp else None, "bytes": list(tok.encode()),
                "top_logprobs": top}

    def _logprobs(self, piece: Piece) -> dict | None:
        if self.top_logprobs is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in zip(piece.token_ids, piece.logprobs,
                                                                         strict=False)]}
        return self._completion_logprobs(piece)

    def complete(self, pieces: list[Piece]) -> dict:
        """The non-streamed answer from all pieces of the request."""
        last = pieces[-1]
        text = "".join(p.text for p in pieces)
        merged = Piece(text, [t for p in pieces for t in p.token_ids], [lp for p in pieces for lp in p.logprobs])
        logprobs = self._logprobs(merged)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": last.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": last.finish_reason}
            obj = "text_completion"
        return {**self._header(obj), "choices": [choice], "usage": usage_dict(last)}

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant role (no text yet); completions have no such chunk."""
        if not self.chat:
            return None
        return {**self._header("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]}

    def chunk(self, piece: Piece) -> dict | None:
        """The stream chunk of ``piece``; ``None`` when it carries nothing to show (text held back)."""
        if not piece.text and piece.finish_reason is None and self.top_logprobs is None:
            return None
        logprobs = self._logprobs(piece)
        if self.chat:
            delta = {"content": piece.text} if piece.text else {}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": piece.finish_reason}
            return {**self._header("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": piece.text, "logprobs": logprobs, "finish_reason": piece.finish_reason}
        return {**self._header("text_completion"), "choices": [choice]}

    def usage_chunk(self, last: Piece) -> dict:
        """The last chunk when ``stream_options.include_usage``: no choices, the request's usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._header(obj), "choices": [], "usage": usage_dict(last)}

    @staticmethod
    def error_chunk(status: int, body: dict) -> dict:
        """An error that happened after the stream started (the HTTP status is already 200)."""
        return {**body, "status": status}
