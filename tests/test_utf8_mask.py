"""The UTF-8 state masks of constrained decoding (``raymoe.runner.utf8_mask``) against Python's own UTF-8 decoder:
a byte string continues well-formed UTF-8 exactly when the incremental decoder accepts it, and each state's mask
allows exactly the tokens that continue it."""

from __future__ import annotations

import codecs

from hypothesis import given
from hypothesis import strategies as st

from raymoe.runner.utf8_mask import Utf8Masks, advance


@given(st.binary(max_size=12))
def test_advance_agrees_with_the_incremental_decoder(data):
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        decoder.decode(data, final=False)
        ok = True
    except UnicodeDecodeError:
        ok = False
    state = advance(0, data)
    assert (state is not None) == ok
    if ok:  # between characters exactly when nothing is buffered
        assert (state == 0) == (decoder.getstate()[0] == b"")


@given(st.lists(st.binary(min_size=1, max_size=4), min_size=1, max_size=80), st.binary(max_size=3))
def test_each_state_mask_allows_exactly_the_tokens_that_continue_it(vocab, prefix):
    masks = Utf8Masks(vocab, [0], (len(vocab) + 31) // 32)
    state = advance(0, prefix)
    if state is None:
        return
    row = masks.words[state]
    for t, data in enumerate(vocab):
        allowed = (int(row[t // 32]) >> (t % 32)) & 1
        if t == 0:  # the special token: between characters only
            assert allowed == (state == 0)
            continue
        end = advance(state, data)
        assert allowed == (end is not None), (state, data)
        if end is not None:
            assert masks.after(state, t) == end
