"""The rank's grammar matchers (``raymoe.runner.grammar.RankGrammars``) step by step: masks leave exactly the
grammar's tokens, a sync row rebuilds the matcher from the tokens generated so far, the background fill (a GPU
rank's path) gives the masks the inline fill gives, completed and dead-ended grammars are reported, and a row that
cannot be served is a dead end, never an exception."""

from __future__ import annotations

import pytest
import torch

from raymoe.runner.grammar import RankGrammars
from raymoe.runner.grammar_compiler import compiler_for_model
from raymoe.step.grammar import GrammarRow, GrammarSpec

SPEC = GrammarSpec("regex", "(yes|no|maybe)!", field="regex")


@pytest.fixture(scope="module")
def compiler(tiny_model):
    import json
    from pathlib import Path

    cfg = json.loads((Path(tiny_model) / "config.json").read_text())
    return compiler_for_model(tiny_model, cfg["vocab_size"], (cfg["eos_token_id"],))


def _allowed(compiler, text: str) -> set[int]:
    """Tokens whose bytes keep ``text`` a prefix of a word of SPEC, or a stop token once it is complete."""
    words = ("yes!", "no!", "maybe!")
    vocab = compiler.info.decoded_vocab
    special = set(compiler.info.special_token_ids)
    if text in words:
        return set(compiler.info.stop_token_ids)
    out = set()
    for t, data in enumerate(vocab):
        if t in special or not data:
            continue
        try:
            s = text + data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if any(w.startswith(s) for w in words):
            out.add(t)
    return out


@pytest.mark.parametrize("background", [False, True])
def test_masks_follow_the_grammar_and_the_matcher_advances(compiler, background):
    vocab_size = compiler.vocab_size
    g = RankGrammars(lambda: compiler, torch.device("cpu"), fill_in_background=background)
    enc = {bytes(v): t for t, v in enumerate(compiler.info.decoded_vocab)}
    path = [enc[b"m"], enc[b"a"], enc[b"y"], enc[b"b"], enc[b"e"], enc[b"!"]]
    text = ""
    for step, token in enumerate(path + [compiler.info.stop_token_ids[0]]):
        row = GrammarRow(1, "r", SPEC, ()) if step == 0 else GrammarRow(1, "r")
        logits = torch.zeros(3, vocab_size)
        logits, gs = g.mask([row], [7, 9, 11], logits)
        allowed = {int(i) for i in torch.nonzero(logits[1] > float("-inf"))}
        assert allowed == _allowed(compiler, text), (step, text)
        assert bool((logits[0] == 0).all()) and bool((logits[2] == 0).all())  # other rows untouched
        ids = torch.tensor([0, token, 0])
        done, dead = g.accept(gs, ids)
        assert dead == []
        assert done == ([1] if step == len(path) else [])
        text += compiler.info.decoded_vocab[token].decode() if step < len(path) else ""


def test_a_sync_row_rebuilds_the_matcher_and_bad_rows_are_dead_ends(compiler, caplog):
    enc = {bytes(v): t for t, v in enumerate(compiler.info.decoded_vocab)}
    g = RankGrammars(lambda: compiler, torch.device("cpu"))
    logits, gs = g.mask([GrammarRow(0, "a", SPEC, (enc[b"n"],))], [3], torch.zeros(1, compiler.vocab_size))
    assert {int(i) for i in torch.nonzero(logits[0] > float("-inf"))} == _allowed(compiler, "n")
    # a resumed request: its tokens do not fit its grammar -> dead end; a row without its matcher -> dead end
    bad = GrammarRow(0, "b", SPEC, (enc[b"x"],))
    orphan = GrammarRow(1, "c")
    broken = GrammarRow(2, "d", GrammarSpec("ebnf", "root ::= nope", field="ebnf"), ())
    logits, gs = g.mask([bad, orphan, broken], [4, 5, 6], torch.zeros(3, compiler.vocab_size))
    assert gs.rows == [] and sorted(gs.dead) == [0, 1, 2]
    assert bool((logits == 0).all())  # dead rows are sampled unmasked (their token is discarded)
    assert g.accept(gs, torch.zeros(3, dtype=torch.int64)) == ([], [0, 1, 2])
    # the matcher of "a" is kept under pool row 3; another request in that row must sync first
    _, gs = g.mask([GrammarRow(0, "other")], [3], torch.zeros(1, compiler.vocab_size))
    assert gs.dead == [0]


def test_ignore_eos_allows_a_stop_token_only_where_nothing_else_fits(compiler):
    stop = set(compiler.info.stop_token_ids)
    enc = {bytes(v): t for t, v in enumerate(compiler.info.decoded_vocab)}
    spec = GrammarSpec("regex", "a{0,2}", field="regex")
    for ignore_eos in (False, True):
        g = RankGrammars(lambda: compiler, torch.device("cpu"))
        allowed_stops = []
        for step in range(3):
            row = GrammarRow(0, "r", spec, (), ignore_eos) if step == 0 else GrammarRow(0, "r")
            logits, gs = g.mask([row], [0], torch.zeros(1, compiler.vocab_size))
            allowed = {int(i) for i in torch.nonzero(logits[0] > float("-inf"))}
            allowed_stops.append(bool(allowed & stop))
            token = enc[b"a"] if step < 2 else min(stop)
            assert g.accept(gs, torch.tensor([token])) == (([0], []) if step == 2 else ([], []))
        # "a{0,2}" may end before each "a": a stop token is allowed at every step unless the request ignores EOS;
        # after two "a" only a stop token fits, ignore_eos or not
        assert allowed_stops == ([True, True, True] if not ignore_eos else [False, False, True])


def test_drafts_are_masked_position_by_position_and_cut_where_the_grammar_refuses(compiler):
    """A verify step: the matcher walks each constrained row's draft, masking the logits at each draft position with
    the grammar's mask there, and stops before a token it refuses; after verification it is rolled back to the
    accepted drafts and advanced by the row's own token, so the next step's mask continues from there."""
    enc = {bytes(v): t for t, v in enumerate(compiler.info.decoded_vocab)}
    m_, a_, y_, x_ = enc[b"m"], enc[b"a"], enc[b"y"], enc[b"x"]
    g = RankGrammars(lambda: compiler, torch.device("cpu"))
    # row 0 (pool row 5): "maybe!" with draft m, a, x, y -> cut before x (cap 2); row 1: unconstrained, draft 2
    # tokens; row 2 (pool row 6): a sync row whose draft is entirely refused (cap 0)
    rows = [GrammarRow(0, "r", SPEC, ()), GrammarRow(2, "s", SPEC, (enc[b"n"],))]
    windows = [(0, [m_, a_, x_, y_]), (5, [1, 2]), (8, [x_])]
    logits, drafted = g.mask_drafts(rows, [5, 9, 6], torch.zeros(10, compiler.vocab_size), windows)
    assert drafted.caps == [2, 2, 0]
    for pos, text in ((0, ""), (1, "m"), (2, "ma"), (8, "n")):
        assert {int(i) for i in torch.nonzero(logits[pos] > float("-inf"))} == _allowed(compiler, text), pos
    for pos in (3, 4, 5, 6, 7, 9):  # past a cap, or unconstrained
        assert bool((logits[pos] == 0).all()), pos
    # the target accepted "m" only and chose "a" itself: the matcher holds "ma"; row 2 accepted nothing, token "o"
    done, dead = g.accept_verified(drafted, torch.tensor([1, 2, 0]), torch.tensor([a_, 0, enc[b"o"]]))
    assert (done, dead) == ([], [])
    logits, gs = g.mask([GrammarRow(0, "r"), GrammarRow(1, "s")], [5, 6], torch.zeros(2, compiler.vocab_size))
    assert {int(i) for i in torch.nonzero(logits[0] > float("-inf"))} == _allowed(compiler, "ma")
    assert {int(i) for i in torch.nonzero(logits[1] > float("-inf"))} == _allowed(compiler, "no")
    _, drafted = g.mask_drafts([GrammarRow(0, "r")], [5], torch.zeros(3, compiler.vocab_size), [(0, [y_, x_])])
    assert drafted.caps == [1]  # "may" fits, "mayx" does not
    with pytest.raises(ValueError, match="accepted 2 drafts"):
        g.accept_verified(drafted, torch.tensor([2]), torch.tensor([0]))
