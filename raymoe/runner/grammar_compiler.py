"""Compiling a request's :class:`~raymoe.step.grammar.GrammarSpec` into a token-level grammar, with xgrammar.

Why xgrammar (``benchmarks/grammar_mask.py``, batch 64, a nested JSON schema, 32k-token vocabulary, on the CI
machine): its per-step mask for the whole batch took 0.30 ms median / 1.00 ms p99, llguidance's 1.07 / 7.23 ms;
xgrammar precomputes the context-independent part of each token mask at compile time (Dong et al., "XGrammar:
Flexible and Efficient Structured Generation Engine for Large Language Models", 2024), which is why the per-step
cost stays low. SGLang and vLLM use it as their default backend.

JSON output is compact (``any_whitespace=False``: no free whitespace between tokens), so a model cannot wander in
whitespace: every token it writes advances the document. ``strict`` follows OpenAI's meaning: properties a schema
does not list are refused unless it allows them. A string with ``minLength``/``maxLength`` (and no ``pattern`` or
``format``) is compiled as the equivalent ``pattern`` over characters other than the JSON control characters
(:func:`xgrammar_schema`): xgrammar's own length-bounded string rule admits raw control characters, which JSON
forbids inside strings.

Ownership: the front end (``raymoe.deploy``) and ``Engine`` compile each request's spec once to refuse a bad one
with a 400 / ``InvalidRequestError``; each rank compiles again for its matchers (``raymoe.runner.grammar``). Both
keep xgrammar's compile cache, so a schema many requests share compiles once per process.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from raymoe.errors import InvalidRequestError
from raymoe.step.grammar import GrammarSpec


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # a dependency of raymoe: only a broken install lacks it
        raise RuntimeError("grammar-constrained decoding needs the xgrammar package (pip install xgrammar)") from e
    return xgrammar


_CONTROL_FREE = "^[^\\x00-\\x1f]{%d,%s}$"  # a JSON string's characters, in the value space xgrammar's patterns use


def _bound_strings(node: Any) -> Any:
    if isinstance(node, list):
        return [_bound_strings(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _bound_strings(v) for k, v in node.items()}
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out)
            and not {"pattern", "format", "enum", "const"} & out.keys()):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", None)
        if isinstance(lo, int) and not isinstance(lo, bool) and (hi is None or isinstance(hi, int)):
            out["pattern"] = _CONTROL_FREE % (lo, "" if hi is None else hi)
        else:  # not integers: leave them for xgrammar to refuse
            out["minLength"] = lo
            if hi is not None:
                out["maxLength"] = hi
    return out


def xgrammar_schema(schema: dict) -> dict:
    """``schema`` with each length-bounded plain string written as a ``pattern`` of non-control characters (the
    module docstring says why); everything else unchanged."""
    return _bound_strings(schema)


COMPILE_ERRORS = (RuntimeError, ValueError, TypeError)
"""What xgrammar (and the JSON parsing before it) raise for a source that does not compile."""


def compile_reason(e: BaseException) -> str:
    """The reason of a compile error, for a client: its last line without xgrammar's ``[time] file.cc:line:``
    prefix, at most 300 characters."""
    text = str(e).strip()
    reason = text.splitlines()[-1] if text else type(e).__name__
    if "] " in reason:
        reason = reason.split(": ", 1)[-1]
    return reason[:300]


class GrammarCompiler:
    """Compiles specs against one model's vocabulary.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's vocabulary (rows of its LM head, tokens; may exceed the tokenizer's).
        stop_token_ids: the tokens that end a request (the model's EOS ids): a completed grammar allows only these.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        xgr = _xgrammar()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._vocab_size = int(self.info.vocab_size)
        self.stop_ids = frozenset(int(t) for t in self.info.stop_token_ids)
        """The tokens a matcher ends on (xgrammar's stop tokens for this vocabulary)."""
        self._lock = threading.Lock()  # the front end compiles from several request threads

    @property
    def vocab_size(self) -> int:
        """Tokens a mask covers."""
        return self._vocab_size

    def compile(self, spec: GrammarSpec) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``spec`` (cached by xgrammar per source text).

        Raises:
            InvalidRequestError: the schema, regular expression or grammar does not compile (an unsupported JSON
                Schema feature, a syntax error, an undefined rule); names ``spec.field`` and quotes the library's
                reason.
        """
        c = self._compiler
        try:
            with self._lock:
                if spec.kind == "json_object":
                    return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
                if spec.kind == "json_schema":  # a source that is not JSON: a ValueError, refused below
                    schema = json.dumps(xgrammar_schema(json.loads(spec.source)))
                    return c.compile_json_schema(schema, any_whitespace=False, strict_mode=spec.strict)
                if spec.kind == "regex":
                    return c.compile_regex(spec.source)
                return c.compile_grammar(spec.source)
        except COMPILE_ERRORS as e:
            raise InvalidRequestError(spec.field, f"the {spec.kind.replace('_', ' ')} does not compile: "
                                                  f"{compile_reason(e)}") from None


@lru_cache(maxsize=4)
def compiler_for_model(model_path: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarCompiler:
    """One :class:`GrammarCompiler` per model folder in this process (its tokenizer is loaded from the folder)."""
    from transformers import AutoTokenizer

    return GrammarCompiler(AutoTokenizer.from_pretrained(model_path), vocab_size, stop_token_ids)
