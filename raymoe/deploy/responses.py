"""OpenAI response bodies and stream chunks for completions and chat completions (plain dicts).

A :class:`ResponseBuilder` is made per request; it turns :class:`~raymoe.deploy.generation.Piece` records into
non-streamed answers (``complete``) or streamed chunks (``chunk``, ``usage_chunk``). Shapes follow the OpenAI API
reference: ``text_completion`` / ``chat.completion`` objects, ``usage`` with cached prompt tokens, completion
logprobs as ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset`` and chat logprobs as ``content``.
Token strings come from a :class:`TokenTexts` cache shared by all requests, so each vocabulary entry is decoded at
most once per server (``logprobs=20`` would otherwise decode 21 tokens per generated token on the event loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from raymoe.deploy.generation import Piece
from raymoe.deploy.harmony import HarmonyStream
from raymoe.deploy.reasoning import ReasoningSplit, ReasoningSplitter
from raymoe.deploy.tool_calls import ToolCall, ToolCallStreamer
from raymoe.step.step_output import TokenLogprobs


class TokenTexts:
    """The text of single tokens (``decode([id])`` with special tokens kept), each decoded once.

    Bounded by the vocabulary: at most ``vocab_size`` entries are ever stored (ids outside it are decoded
    without caching).

    Args:
        tokenizer: the model's Hugging Face tokenizer. vocab_size: the model's vocabulary size.
    """

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if 0 <= token_id < self.vocab_size:
                self._texts[token_id] = text
        return text


def usage_dict(piece: Piece) -> dict:
    """The ``usage`` object from a request's last piece; with speculative decoding also OpenAI's
    ``completion_tokens_details`` (draft tokens accepted and rejected: ``completion_tokens`` keeps its meaning)."""
    usage = {"prompt_tokens": piece.prompt_tokens, "completion_tokens": piece.completion_tokens,
             "total_tokens": piece.prompt_tokens + piece.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": piece.cached_tokens}}
    if piece.accepted_prediction_tokens or piece.rejected_prediction_tokens:
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": piece.accepted_prediction_tokens,
                                              "rejected_prediction_tokens": piece.rejected_prediction_tokens}
    return usage


class ResponseBuilder:
    """Builds the answers of one request.

    Args:
        chat: chat completion (else text completion). model: the served model name. token_text: token id ->
            its text, for logprobs (a :class:`TokenTexts`). top_logprobs: alternatives asked per token (None: no
            logprobs). request_id: the HTTP request's id; the answer's ``id`` is ``cmpl-<request_id>`` or
            ``chatcmpl-<request_id>``. reasoning: for a chat answer, the splitter that moves the thinking to
            ``reasoning_content`` (``raymoe.deploy.reasoning``; None: all text is ``content``). tools: for a chat
            answer with tools, the parser of the model's tool calls (``raymoe.deploy.tool_calls``; applied to the
            content, after the reasoning split). parallel_tool_calls: False keeps only the first call.
        harmony: for a harmony chat answer (gpt-oss), the parser of its token ids into reasoning, content and tool
            calls (``raymoe.deploy.harmony``); it replaces ``reasoning`` and ``tools``.
        index: the choice this builder answers (``n`` > 1: one builder per choice, ``raymoe.deploy.choices``).
        prompt_scores: the ``prompt_logprobs`` extension: ``(prompt token ids, k)`` (vLLM's answer field: per prompt
            token None for the first, else ``{token id: {logprob, rank, decoded_token}}`` for the token and the top
            k; a completion's choice carries it, a chat answer at its top level), or None.
    """

    def __init__(self, chat: bool, model: str, token_text: Callable[[int], str], top_logprobs: int | None,
                 request_id: str, reasoning: ReasoningSplitter | None = None, tools: ToolCallStreamer | None = None,
                 parallel_tool_calls: bool = True, harmony: HarmonyStream | None = None, index: int = 0,
                 prompt_scores: tuple[list[int], int] | None = None):
        self.chat = chat
        self.prompt_scores = prompt_scores
        self.index = index
        self.harmony = harmony
        self.reasoning = reasoning
        self.tools = tools
        self.parallel_tool_calls = parallel_tool_calls
        self.model = model
        self._token = token_text
        self.top_logprobs = top_logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self._text_offset = 0

    def _header(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

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
            {"token": (text := self._token(t)), "logprob": v, "bytes": list(text.encode())}
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
            reasoning, content, calls = self._split_chat(merged, final=True)
            message = {"role": "assistant", "content": None if calls and not content.strip() else content}
            if self.reasoning is not None or self.harmony is not None:
                message["reasoning_content"] = reasoning or None
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
            choice = {"index": self.index, "message": message, "logprobs": logprobs,
                      "finish_reason": "tool_calls" if calls else last.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": last.finish_reason}
            obj = "text_completion"
        answer = {**self._header(obj), "choices": [choice], "usage": usage_dict(last)}
        if self.prompt_scores is not None:
            entries = self._prompt_entries(pieces[0].prompt_logprobs)
            if self.chat:
                answer["prompt_logprobs"] = entries
            else:
                choice["prompt_logprobs"] = entries
        return answer

    def _prompt_entries(self, scores: list[TokenLogprobs | None] | None) -> list[dict | None]:
        """vLLM's ``prompt_logprobs`` entries (class docstring) from the engine's prompt scores (None where a score
        is missing, e.g. a request aborted before its first token)."""
        ids, k = self.prompt_scores
        scores = list(scores or [])
        out: list[dict | None] = [None]
        for i, tid in enumerate(ids[1:], 1):
            s = scores[i] if i < len(scores) else None
            if s is None:
                out.append(None)
                continue
            entry = {str(tid): {"logprob": s.logprob, "rank": s.rank, "decoded_token": self._token(tid)}}
            for r, (t, v) in enumerate(zip(s.top_token_ids[:k], s.top_logprobs[:k], strict=True), 1):
                entry.setdefault(str(t), {"logprob": v, "rank": r, "decoded_token": self._token(t)})
            out.append(entry)
        return out

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant role (no text yet); completions have no such chunk."""
        if not self.chat:
            return None
        return {**self._header("chat.completion.chunk"),
                "choices": [{"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]}

    def chunk(self, piece: Piece) -> dict | None:
        """The stream chunk of ``piece``; ``None`` when it carries nothing to show (text held back)."""
        if not piece.text and piece.finish_reason is None and self.top_logprobs is None and (
                self.harmony is None or not piece.token_ids):
            return None
        if self.chat and (self.reasoning is not None or self.tools is not None or self.harmony is not None):
            return self._split_chunk(piece)
        logprobs = self._logprobs(piece)
        if self.chat:
            delta = {"content": piece.text} if piece.text else {}
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": piece.finish_reason}
            return {**self._header("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": self.index, "text": piece.text, "logprobs": logprobs, "finish_reason": piece.finish_reason}
        return {**self._header("text_completion"), "choices": [choice]}

    def _split_chat(self, piece: Piece, final: bool) -> tuple[str, str, tuple[ToolCall, ...]]:
        """The next piece of a chat answer as (reasoning, content, tool calls); ``final``: the answer ended (what the
        splitters held back is placed, the held tool-call text parsed). A harmony answer is read from its token
        ids, any other from its text."""
        if self.harmony is not None:
            split = self.harmony.feed(piece.token_ids)
            calls: tuple[ToolCall, ...] = ()
            if final:
                rest, calls = self.harmony.finish()
                split = ReasoningSplit(split.reasoning + rest.reasoning, split.content + rest.content)
            return split.reasoning, split.content, calls if self.parallel_tool_calls else calls[:1]
        text = piece.text
        reasoning, content, calls = "", text, ()
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            if final:
                rest = self.reasoning.finish()
                split = ReasoningSplit(split.reasoning + rest.reasoning, split.content + rest.content)
            reasoning, content = split.reasoning, split.content
        if self.tools is not None:
            content = self.tools.feed(content)
            if final:
                parsed = self.tools.finish()
                content += parsed.content
                calls = parsed.calls if self.parallel_tool_calls else parsed.calls[:1]
        return reasoning, content, calls

    def _split_chunk(self, piece: Piece) -> dict | None:
        """A chat chunk whose text is split into ``reasoning_content``, ``content`` and, at the end, ``tool_calls``
        (partial tags and call text held back until they are whole)."""
        final = piece.finish_reason is not None
        reasoning, content, calls = self._split_chat(piece, final)
        if not (reasoning or content) and not final and self.top_logprobs is None:
            return None
        delta = {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": content} if content else {}),
                 **({"tool_calls": [c.to_openai(i) for i, c in enumerate(calls)]} if calls else {})}
        choice = {"index": self.index, "delta": delta, "logprobs": self._logprobs(piece),
                  "finish_reason": "tool_calls" if calls else piece.finish_reason}
        return {**self._header("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, last: Piece) -> dict:
        """The last chunk when ``stream_options.include_usage``: no choices, the request's usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._header(obj), "choices": [], "usage": usage_dict(last)}
