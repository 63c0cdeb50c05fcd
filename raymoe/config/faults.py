"""Fault-tolerance options: how the front end resumes requests an engine fault interrupted
(``raymoe.client.request_resume``), and whether a rank group shrinks onto its survivors instead of being rebuilt
(``raymoe.actors.elastic_plan``). The bound that turns a stalled rank into a fault is
``EngineConfig.step_timeout_s``."""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.config.option import option
from raymoe.errors import InvalidRequestError


@dataclass(frozen=True)
class FaultConfig:
    """What a request survives; each field's help says what it means.

    Raises:
        InvalidRequestError: a count or bound out of range (named).
    """

    max_request_resumes: int = option(
        3, help="times one request is resumed after an engine fault (a rank killed, stopped past step_timeout_s or "
                "its node lost; the driver loop or the driver actor died): the front end keeps the tokens it "
                "streamed, waits until the engine is healthy again, and submits the request with them; the engine "
                "re-prefills prompt + those tokens and the stream goes on after a pause. Greedy and seeded requests "
                "give the tokens of an undisturbed run. 0: a fault ends every in-flight request with an "
                "engine_unhealthy error (503 before the first token, an SSE error event after).")
    request_resume_timeout_s: float = option(
        600.0, help="longest a request waits for the engine to recover before it is resumed, seconds; past it the "
                    "request ends with the fault's engine_unhealthy error.")
    elastic_ep: bool = option(
        True, help="after a rank fault, keep serving on the DP groups that lost no rank when every logical expert "
                   "still has a slot on them (redundant experts placed on two ranks, ep_num_redundant_experts; "
                   "experts tensor-parallel inside each group need none): the surviving ranks stay in their "
                   "processes, form new process groups and load the shrunken placement, and a replacement rank "
                   "rejoins when Ray can place it (raymoe.actors.elastic_plan). False, or when the survivors cannot "
                   "serve alone: the whole rank group is rebuilt.")
    elastic_ep_rejoin_after_s: float = option(
        5.0, help="after a shrink, how long the engine serves on the survivors before it places the replacement "
                  "ranks, seconds (a rank that dies again at once does not make the group regrow in a loop); the "
                  "group grows back once they have started.")

    def __post_init__(self) -> None:
        if not isinstance(self.max_request_resumes, int) or self.max_request_resumes < 0:
            raise InvalidRequestError("max_request_resumes", f"must be an integer >= 0, got "
                                                             f"{self.max_request_resumes!r}")
        if not self.elastic_ep_rejoin_after_s >= 0:
            raise InvalidRequestError("elastic_ep_rejoin_after_s", f"must be >= 0, got "
                                                                   f"{self.elastic_ep_rejoin_after_s!r}")
        if not self.request_resume_timeout_s > 0:
            raise InvalidRequestError("request_resume_timeout_s", f"must be > 0, got {self.request_resume_timeout_s!r}")
