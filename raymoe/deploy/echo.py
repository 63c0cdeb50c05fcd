"""``echo`` on ``POST /v1/completions``: the answer repeats the prompt before the completion, and with ``logprobs``
scores it: each prompt token's log-probability given the tokens before it (the first has none, ``null``) and the top
alternatives there, as OpenAI's legacy completions did and vLLM does. Evaluation harnesses score answers this way
(``echo`` + ``logprobs`` + ``max_tokens`` 0 or 1, e.g. lm-evaluation-harness's ``local-completions``
log-likelihood requests); ``max_tokens`` 0 (only with ``echo``) scores the prompt and generates nothing.

The engine computes the scores (``SamplingParams.prompt_logprobs``, ``raymoe.step.prompt_scores``) and sends them
with the request's first output token; :class:`Echo` puts the prompt's text, token ids and scores in front of the
first piece, so the answer builders (``raymoe.deploy.responses``) lay them out like generated tokens: ``tokens``,
``token_logprobs``, ``top_logprobs`` and ``text_offset`` run over prompt and completion. With ``max_tokens`` 0 the
engine still samples one token (a prefill's logits give it anyway); it is dropped and not counted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raymoe.deploy.http_errors import APIError
from raymoe.step.step_output import TokenLogprobs

if TYPE_CHECKING:  # (generation imports request_prep, which imports this module)
    from raymoe.deploy.generation import Piece


@dataclass(frozen=True)
class Echo:
    """What a completion request with ``echo`` repeats (module docstring).

    Attributes:
        text: the prompt's text (a token-id prompt decoded). prompt_ids: its token ids.
        score_only: ``max_tokens`` was 0: the generated token is dropped (``completion_tokens`` 0, finish
            ``length``).
    """

    text: str
    prompt_ids: tuple[int, ...]
    score_only: bool = False

    def piece(self, piece: Piece, first: bool, prompt_logprobs: list[TokenLogprobs | None] | None,
              with_logprobs: int | None) -> Piece:
        """``piece`` as the client sees it: the first one opens with the prompt (with ``with_logprobs`` = k its
        scores, each with its top k; missing ones, as for a request aborted before its first token, are None); with
        ``score_only`` the generated tokens are dropped."""
        if self.score_only:
            piece = dataclasses.replace(piece, text="", token_ids=[], logprobs=[], completion_tokens=0,
                                        finish_reason="length" if piece.finish_reason == "stop"
                                        else piece.finish_reason)
        if not first:
            return piece
        scores: list[TokenLogprobs | None] = []
        if with_logprobs is not None:  # (the engine may have scored more alternatives, for prompt_logprobs)
            scores = [s if s is None or len(s.top_token_ids) <= with_logprobs else
                      TokenLogprobs(s.logprob, s.top_token_ids[:with_logprobs], s.top_logprobs[:with_logprobs], s.rank)
                      for s in (prompt_logprobs or [])[:len(self.prompt_ids)]]
            scores += [None] * (len(self.prompt_ids) - len(scores))
        return dataclasses.replace(piece, text=self.text + piece.text,
                                   token_ids=[*self.prompt_ids, *piece.token_ids],
                                   logprobs=[*scores, *piece.logprobs] if with_logprobs is not None else piece.logprobs)


def echo_of(echo: bool | None, prompt: str | list[int], ids: list[int], max_tokens: int | None,
            tokenizer) -> Echo | None:
    """The request's :class:`Echo` (None without ``echo``).

    Args:
        echo: the body's ``echo``. prompt: its prompt (text, or token ids). ids: the prompt's token ids.
        max_tokens: the body's ``max_tokens`` (None: not given). tokenizer: the model's.
    Raises:
        APIError: 400 naming ``max_tokens`` when it is 0 without ``echo`` (nothing would be returned).
    """
    if not echo:
        if max_tokens == 0:
            raise APIError(400, "max_tokens 0 is only allowed with echo=true (the prompt is scored, nothing is "
                                "generated)", param="max_tokens")
        return None
    text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
    return Echo(text, tuple(ids), max_tokens == 0)
