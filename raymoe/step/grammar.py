"""Grammar-constrained decoding records: what a request asks for (:class:`GrammarSpec`) and what a step tells the
ranks about its constrained rows (:class:`GrammarRow`). Plain data, no grammar library.

Ownership: the front end (or an ``Engine`` caller) puts a ``GrammarSpec`` in the request's ``SamplingParams``; the
scheduler lists a ``GrammarRow`` for each constrained row that samples in a step (``ScheduleBatch.build``); the rank
keeps one grammar matcher per constrained request (``raymoe.runner.grammar``), masks those rows' logits before the
sampler and advances the matcher by the sampled token. Rows without a grammar are not listed: an unconstrained
step carries an empty tuple and the rank does no grammar work.
"""

from __future__ import annotations

from dataclasses import dataclass

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")
"""``json_object``: any JSON object; ``json_schema``: JSON valid under a JSON Schema (``source`` is its JSON text);
``regex``: text matching a regular expression; ``ebnf``: text of an EBNF grammar (xgrammar's GBNF dialect, rule
``root`` first)."""

MAX_GRAMMAR_CHARS = 1 << 20  # a schema or grammar of a megabyte already takes seconds to compile


@dataclass(frozen=True)
class GrammarSpec:
    """A request's output constraint.

    Attributes:
        kind: one of :data:`GRAMMAR_KINDS`.
        source: the schema (JSON text), regular expression or EBNF text; ``""`` for ``json_object``.
        field: the request field it came from (``response_format``, ``regex``, ``ebnf``, ``tool_choice``), named
            by errors about it.
        strict: ``json_schema`` only: properties the schema does not list are refused unless it allows them
            (OpenAI's ``strict``); False follows JSON Schema's default (allowed).
    Raises:
        ValueError: an unknown kind (a programming error; what a client can get wrong is :meth:`problem`).
    """

    kind: str
    source: str = ""
    field: str = "response_format"
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"{self.field}: unknown grammar kind {self.kind!r}; one of {GRAMMAR_KINDS}")

    def problem(self) -> str | None:
        """Why this spec cannot be a constraint, from its shape alone (None: it may compile): a source that is not
        a string or is too long, an empty regex or grammar. ``SamplingParams.validate`` raises it as an
        ``InvalidRequestError`` naming ``field``; it runs again at each admission in the driver's step loop, so it
        reads nothing of the source. Whether the source parses and compiles (a schema that is not JSON included)
        is ``raymoe.runner.grammar_compiler``'s, checked once by the front end or ``Engine``."""
        if not isinstance(self.source, str) or len(self.source) > MAX_GRAMMAR_CHARS:
            return f"must be a string of at most {MAX_GRAMMAR_CHARS} characters"
        if not isinstance(self.strict, bool):
            return "strict must be a bool"
        if self.kind in ("regex", "ebnf") and not self.source:
            return f"an empty {self.kind} allows nothing"
        return None


@dataclass(frozen=True)
class GrammarRow:
    """One constrained row of a step.

    Attributes:
        row: the row in the step's batch (``0 <= row < bs``).
        rid: the request's id (the rank keeps its matcher under it).
        spec: the request's constraint, and output_ids: the tokens it has generated so far, both sent on its first
            sampling step since each admission to the group (the rank then builds the matcher and advances it over
            them: a resumed or migrated request continues its grammar); both ``None`` on later steps, where the
            rank's matcher already holds them (a step's payload stays a few bytes per constrained row).
        ignore_eos: with a sync row, the request's ``ignore_eos``: the rank then allows a stop token only where the
            grammar allows nothing else (where it is complete), so the request goes on to ``max_tokens`` as far
            as its grammar lets it.
    Raises:
        ValueError: ``row`` is negative, or only one of ``spec`` and ``output_ids`` is given.
    """

    row: int
    rid: str
    spec: GrammarSpec | None = None
    output_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.row < 0:
            raise ValueError(f"GrammarRow.row must be >= 0, got {self.row}")
        if (self.spec is None) != (self.output_ids is None):
            raise ValueError("GrammarRow carries its spec and output_ids together (a sync row) or neither")
