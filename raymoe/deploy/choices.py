"""``n`` > 1: several choices for one request (OpenAI's ``n``; vLLM's parallel sampling).

Each choice is an engine request of its own, with the request's prompt and parameters (the radix cache lets the
later ones reuse the prompt's KV once the first has prefilled it) and its own :class:`ResponseBuilder` (index,
reasoning splitter, tool-call parser, log-prob offsets). A seeded request gives choice ``i`` the seed
:func:`choice_seed` derives from it, so its choices differ from one another and the whole answer repeats with the
same seed (choice 0 keeps the seed: ``n=1`` answers as before). Greedy choices are all the same, as in OpenAI and
vLLM. The answer lists the choices by index with one ``usage``: the prompt counted once, the completions summed.
A stream interleaves the choices' chunks as their tokens arrive, each chunk naming its choice's ``index``; the
stream ends after every choice finished (the usage chunk, then ``[DONE]``).

A completion's batch of prompts (``prompt`` a list of them, as in OpenAI and vLLM) is answered the same way: prompt
``p``'s ``n`` choices are choices ``p * n ... p * n + n - 1``, each prompt prepared and checked on its own (an error
names ``prompt[p]``), and the usage counts every prompt once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from raymoe.deploy.generation import Piece
from raymoe.deploy.http_errors import from_raymoe_error
from raymoe.deploy.request_prep import PreparedRequest
from raymoe.deploy.responses import ResponseBuilder, usage_dict
from raymoe.deploy.sse import sse
from raymoe.errors import RaymoeError
from raymoe.runner.sampler import splitmix64
from raymoe.scheduler.sampling_params import MAX_SEED


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded ``seed`` (None: unseeded): ``seed`` itself for choice 0,
    else a SplitMix64 mix of both (Steele et al., OOPSLA 2014), in [0, ``MAX_SEED``]."""
    if seed is None or index == 0:
        return seed
    return splitmix64(splitmix64(seed) ^ index) & MAX_SEED


def choice_prep(prep: PreparedRequest, index: int) -> PreparedRequest:
    """``prep`` for choice ``index`` (its seed, :func:`choice_seed`)."""
    if index == 0 or prep.params.seed is None:
        return prep
    return dataclasses.replace(prep, params=dataclasses.replace(prep.params, seed=choice_seed(prep.params.seed,
                                                                                             index)))


async def gather_all(aws) -> list:
    """Await every awaitable of ``aws`` concurrently; on an error or a cancellation the others are cancelled and
    awaited before it propagates (their streams can then be closed)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def summed_usage(lasts: list[Piece], per_prompt: int | None = None) -> dict:
    """One ``usage`` for the choices' last pieces: each prompt (and its cached tokens) once, completions summed.
    ``per_prompt``: choices per prompt of a batch (choice ``i`` answers prompt ``i // per_prompt``); None: one
    prompt."""
    usages = [usage_dict(p) for p in lasts]
    out = dict(usages[0])
    firsts = usages[::per_prompt] if per_prompt else usages[:1]
    out["prompt_tokens"] = sum(u["prompt_tokens"] for u in firsts)
    out["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts)}
    out["completion_tokens"] = sum(u["completion_tokens"] for u in usages)
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    details = [u["completion_tokens_details"] for u in usages if "completion_tokens_details" in u]
    if details:
        out["completion_tokens_details"] = {k: sum(d[k] for d in details) for k in details[0]}
    return out


def merged_answer(builders: list[ResponseBuilder], pieces: list[list[Piece]], per_prompt: int | None = None) -> dict:
    """The non-streamed answer of every choice: ``builders[i].complete(pieces[i])``, the choices in one body
    (``per_prompt``: as in :func:`summed_usage`)."""
    answers = [b.complete(p) for b, p in zip(builders, pieces, strict=True)]
    return {**answers[0], "choices": [a["choices"][0] for a in answers],
            "usage": summed_usage([p[-1] for p in pieces], per_prompt)}


async def _interleave(streams: dict[int, AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece | None]]:
    """``(choice, piece)`` as the choices' pieces arrive; ``(choice, None)`` when a choice's stream ended. An error
    of any stream is raised here. The pumping tasks are cancelled and awaited on exit, so the streams can be
    closed afterwards."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[Piece]) -> None:
        try:
            async for piece in it:
                await queue.put((i, piece, None))
            await queue.put((i, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in streams.items()]
    try:
        left = len(tasks)
        while left:
            i, piece, error = await queue.get()
            if error is not None:
                raise error
            if piece is None:
                left -= 1
            yield i, piece
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def choice_events(builders: list[ResponseBuilder], firsts: list[Piece | None],
                        pieces: list[AsyncIterator[Piece]], include_usage: bool, request_id: str,
                        close, per_prompt: int | None = None) -> AsyncIterator[str]:
    """The server-sent events of a streamed request with several choices (module docstring). ``firsts``: each
    choice's first piece (already awaited); ``close``: awaited at the end, closes every choice's stream;
    ``per_prompt``: as in :func:`summed_usage`."""
    try:
        for b in builders:
            opening = b.first_chunk()
            if opening is not None:
                yield sse(opening)
        lasts: list[Piece | None] = [None] * len(builders)

        def take(i: int, piece: Piece | None) -> str | None:
            """Choice ``i``'s event for ``piece`` (None: nothing to show); a stream that ended early aborted."""
            piece = piece or Piece("", [], finish_reason="abort")
            if piece.finish_reason is not None:
                lasts[i] = piece
            chunk = builders[i].chunk(piece)
            return None if chunk is None else sse(chunk)

        for i, first in enumerate(firsts):
            if (event := take(i, first)) is not None:
                yield event
        failed = False
        try:
            async for i, piece in _interleave({i: s for i, s in enumerate(pieces) if lasts[i] is None}):
                if lasts[i] is None and (event := take(i, piece)) is not None:
                    yield event
        except RaymoeError as e:  # the engine failed mid-stream: the status is already 200
            yield sse(from_raymoe_error(e).body(request_id))
            failed = True
        if include_usage and not failed:
            yield sse({**builders[0].usage_chunk(lasts[0]), "usage": summed_usage(lasts, per_prompt)})
        yield sse("[DONE]")
    finally:
        await close()
