"""PendingStep: a step the rank has launched but not answered yet (the rank-side half of "no host sync in a step").

``ModelRunner.launch_step`` prepares the step, runs the forward and the sampler and starts copying the sampled ids
(and any log-probs) to the host through the platform (``Platform.copy_to_host``: on CUDA a non-blocking copy into
pinned memory and an event behind it), then returns at once. Nothing in that path reads a device value on the
host (``tests/test_decode_host_sync.py`` proves it under ``HostSyncGuard``), so on a GPU the host can go on to
prepare and launch the next step while this one still runs; the next step's placeholder tokens resolve on the
device (``raymoe.runner.future_tokens``). :meth:`PendingStep.result` waits for the copy's event and builds the
``StepOutput``: SGLang's overlap scheduler does the same with its ``copy_done`` event.

Ownership: the runner makes it; whoever answers the driver (the rank worker's step call, the step channel's reply
thread, the in-process executor's ``collect``) calls :meth:`PendingStep.result` once, in launch order.
"""

from __future__ import annotations

import time

from raymoe.platform.interface import HostCopy
from raymoe.runner.prompt_logprobs import PendingPromptScores
from raymoe.runner.sampler import SampledTokens
from raymoe.step.step_output import StepOutput


class PendingStep:
    """A launched step whose tokens are on their way to the host.

    Args:
        sampled: the step's device results (None: a step without rows, IDLE).
        copy: their host copy (None with ``sampled``).
        started: ``time.perf_counter()`` when the step began on the rank, seconds.
        load: the expert-load counters' host copy ([L, E] int64), when the step's update asked for them.
        grammar: ``(done, dead)`` rows of the step's constrained requests (``raymoe.runner.grammar``), known at
            launch.
        verify: a TARGET_VERIFY step: ``copy`` holds the ids and then the rows' accepted draft counts
            (``raymoe.runner.spec_verify``).
        drafts: the MTP layer's drafts per row for the next step (``raymoe.runner.mtp_drafter``), or ``()``.
        prompt: the step's prompt scores on their way to the host (``raymoe.runner.prompt_logprobs``), or None.
    """

    def __init__(self, sampled: SampledTokens | None, copy: HostCopy | None, started: float,
                 load: HostCopy | None = None, grammar: tuple[list[int], list[int]] | None = None,
                 verify: bool = False, drafts: tuple | list = (), prompt: PendingPromptScores | None = None):
        self.sampled = sampled
        self.prompt = prompt
        self.verify = verify
        self.drafts = tuple(drafts)
        self.copy = copy
        self.load = load
        self.started = started
        self.grammar = grammar
        # a copy that is complete at launch (a CPU rank) ends the step's time here, not when it is collected
        self._done_at = time.perf_counter() if copy is None or copy.ready() else None
        self._output: StepOutput | None = None

    def ready(self) -> bool:
        """Whether :meth:`result` would return without waiting for the device."""
        return self._output is not None or ((self.copy is None or self.copy.ready())
                                            and (self.load is None or self.load.ready())
                                           and (self.prompt is None or self.prompt.ready()))

    def result(self) -> StepOutput:
        """The step's answer: waits for the token copy (the only host sync of the step), then converts it.

        ``forward_seconds`` runs from the step's start on the rank to when its tokens were known on the host: at
        launch on a synchronous device, else when this call saw the copy complete.
        """
        if self._output is not None:
            return self._output
        accept: tuple[int, ...] = ()
        if self.sampled is None:
            ids, logprobs = [], []
        elif self.verify:
            self.copy.wait()
            ids, accept = self.copy.tensors[0].tolist(), tuple(self.copy.tensors[1].tolist())
            logprobs = [None] * len(ids)
        else:
            self.copy.wait()
            ids, logprobs = self.sampled.answer(self.copy.tensors)
        done_at = self._done_at if self._done_at is not None else time.perf_counter()
        load = None
        if self.load is not None:
            self.load.wait()
            load = self.load.tensors[0].reshape(-1).tolist()
        done, dead = self.grammar or ((), ())
        prompt = self.prompt.answer() if self.prompt is not None else ()
        self._output = StepOutput(ids, logprobs, done_at - self.started, load, tuple(done), tuple(dead), accept,
                                  self.drafts, prompt)
        self.sampled = self.copy = self.load = self.prompt = None
        return self._output
