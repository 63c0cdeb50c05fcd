"""The grammar of a forced tool call: ``tool_choice`` ``required`` or a named function, in the model family's
tool-call format, with each call's ``arguments`` valid under its tool's JSON schema.

``auto`` lets the model decide and parses what it wrote (``raymoe.deploy.tool_calls``); ``required`` and a named
function are guarantees, so the output is constrained (``raymoe.runner.grammar``) to exactly what the parser reads
back. Per format (the same ones ``tool_calls`` parses):

- ``qwen3``: ``<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>``, calls separated by ``\\n``;
- ``mistral``: ``[TOOL_CALLS][{"name": N, "arguments": A}, ...]``;
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\nA
  \\n```<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``.

Each call is one of the allowed tools: ``{"name": <that tool's name>, "arguments": <its parameters schema>}`` as a
JSON schema, the alternatives joined (xgrammar ``Grammar.union``), the literal markers around them
(``Grammar.concat``). ``parallel_tool_calls`` false allows exactly one call, else one or more. The result is EBNF
text (a :class:`~raymoe.step.grammar.GrammarSpec` of kind ``ebnf``), so it travels to the ranks like any grammar.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from raymoe.errors import InvalidRequestError
from raymoe.runner.grammar_compiler import COMPILE_ERRORS, compile_reason, xgrammar_schema
from raymoe.step.grammar import GrammarSpec


def _literal(xgr, text: str):
    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text))


def _json(xgr, schema: dict):
    try:
        return xgr.Grammar.from_json_schema(json.dumps(xgrammar_schema(schema)), any_whitespace=False,
                                            strict_mode=True)
    except COMPILE_ERRORS as e:
        raise InvalidRequestError("tools", f"a tool's parameters schema does not compile: {compile_reason(e)}") \
            from None


def _call_schema(name: str, parameters: dict | None) -> dict:
    return {"type": "object", "properties": {"name": {"const": name},
                                             "arguments": parameters or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def _union(xgr, grammars: list):
    return grammars[0] if len(grammars) == 1 else xgr.Grammar.union(*grammars)


def _one_or_more(xgr, one, sep: str):
    """One or more of ``one``, ``sep`` between them: ``one``'s start rule (xgrammar names it ``root``, first line)
    becomes a rule of its own that a new ``root`` repeats."""
    text = str(one)
    if not text.startswith("root ::="):
        raise RuntimeError("xgrammar printed a grammar whose first rule is not root")
    item = "raymoe_tool_call"
    ebnf = f"root ::= {item} ({json.dumps(sep)} {item})*\n{item} ::=" + text[len("root ::="):]
    return xgr.Grammar.from_ebnf(ebnf)


def tool_call_grammar(parser: str, tools: Sequence[Any], choice: Any, parallel: bool) -> GrammarSpec:
    """The grammar forcing ``choice`` (``"required"`` or a named function) over ``tools``.

    Args:
        parser: the model's tool-call format (``raymoe.deploy.tool_calls.TOOL_CALL_PARSERS``).
        tools: the request's ``ToolDef``s (``function.name``, ``function.parameters``).
        choice: ``"required"`` or a ``NamedToolChoice`` (``function.name``).
        parallel: ``parallel_tool_calls`` (False: exactly one call).
    Returns:
        an ``ebnf`` spec whose ``field`` is ``tool_choice``.
    Raises:
        InvalidRequestError: a named function that is not among the tools (``tool_choice``), or a parameters
            schema that does not compile (``tools``).
    """
    import xgrammar as xgr

    if choice == "required":
        chosen = list(tools)
    else:
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise InvalidRequestError("tool_choice", f"names the function {choice.function.name!r}, which is not "
                                                     "among the tools")
    if parser == "deepseek_v3":
        calls = [xgr.Grammar.concat(
            _literal(xgr, f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{t.function.name}\n```json\n"),
            _json(xgr, t.function.parameters or {"type": "object"}),
            _literal(xgr, "\n```<｜tool▁call▁end｜>")) for t in chosen]
        one = _union(xgr, calls)
        body = _one_or_more(xgr, one, "") if parallel else one
        grammar = xgr.Grammar.concat(_literal(xgr, "<｜tool▁calls▁begin｜>"), body,
                                     _literal(xgr, "<｜tool▁calls▁end｜>"))
    elif parser == "mistral":
        items = {"anyOf": [_call_schema(t.function.name, t.function.parameters) for t in chosen]}
        array = {"type": "array", "items": items, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        grammar = xgr.Grammar.concat(_literal(xgr, "[TOOL_CALLS]"), _json(xgr, array))
    elif parser == "qwen3":
        one = xgr.Grammar.concat(
            _literal(xgr, "<tool_call>\n"),
            _union(xgr, [_json(xgr, _call_schema(t.function.name, t.function.parameters)) for t in chosen]),
            _literal(xgr, "\n</tool_call>"))
        grammar = _one_or_more(xgr, one, "\n") if parallel else one
    else:
        raise InvalidRequestError("tool_choice", f"no tool-call format {parser!r}")
    return GrammarSpec("ebnf", str(grammar), field="tool_choice")
