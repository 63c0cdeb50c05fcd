"""A fake engine for the HTTP front-end tests: the ``EngineClient`` surface the app uses, answering token ids on
demand on the caller's event loop (no Ray, no model)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from raymoe.actors.driver_service import EngineStats, RequestDelta
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.step_output import TokenLogprobs


class FakeEngine:
    """The EngineClient surface the app uses. ``generate`` yields one token per loop turn (``delay_s`` apart)
    until ``max_tokens``; ``open`` holds the ids whose generator has not been closed (closing = abort)."""

    def __init__(self, tokenizer, delay_s: float = 0.0, max_context_len: int = 4096):
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_running_requests=4, max_queued_requests=4),
                                      parallel=SimpleNamespace(dp_size=1))
        self.model_config = SimpleNamespace(vocab_size=len(tokenizer), model_type="qwen3_moe", eos_token_ids=())
        self.model_name = "fake"
        self.tokenizer = tokenizer
        self.max_context_len = max_context_len
        self.delay_s = delay_s
        self.open: set[str] = set()
        self.closed: list[str] = []
        self.gate: asyncio.Event | None = None  # when set to an Event, generation waits for it
        self.seen: list[tuple[list[int], SamplingParams]] = []  # (prompt ids, params) of every request
        # (wall clock, CPU time of the event loop's thread) at every token: the CPU the loop spent between two
        # tokens is the largest slice of work it ran in that gap.
        self.token_clock: list[tuple[float, float]] = []
        # Token ids generated in turn (None: ``i % 200 + 30``, some of which only decode to text with their
        # neighbours, so that output comes in bursts).
        self.token_cycle: list[int] | None = None

    async def generate(self, request_id, prompt_ids, params):
        self.seen.append((list(prompt_ids), params))
        self.open.add(request_id)
        try:
            if self.gate is not None:
                await self.gate.wait()
            for i in range(params.max_tokens):
                await asyncio.sleep(self.delay_s)
                lp = None
                if params.logprobs is not None:
                    top = [(i + k) % 200 + 30 for k in range(params.logprobs)]
                    lp = TokenLogprobs(-1.0, top, [-1.0 - k for k in range(params.logprobs)])
                self.token_clock.append((time.perf_counter(), time.thread_time()))
                last = i == params.max_tokens - 1
                token = i % 200 + 30 if self.token_cycle is None else self.token_cycle[i % len(self.token_cycle)]
                scores = None
                if i == 0 and params.prompt_logprobs is not None:  # position j scores prompt token j + 1 at -(j + 1)
                    k = params.prompt_logprobs
                    scores = [None] + [TokenLogprobs(-(j + 1.0), [40 + n for n in range(k)], [-0.5] * k)
                                       for j in range(len(prompt_ids) - 1)]
                yield RequestDelta(request_id, [token], [lp], finished=last,
                                   finish_reason="length" if last else None, prompt_tokens=len(prompt_ids),
                                   completion_tokens=i + 1, prompt_logprobs=scores)
        finally:
            self.open.discard(request_id)
            self.closed.append(request_id)

    async def abort(self, request_id: str) -> None:
        pass

    async def stats(self) -> EngineStats:
        return EngineStats(len(self.open), 0, 0.0, 0, 0, 0, True)

    async def healthy(self) -> bool:
        return True
