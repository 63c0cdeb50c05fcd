"""A GPU rank's step channel answers from a second thread (``serve_steps(deferred=True)``): its step thread launches
step N+1 while step N's tokens are still on their way to the host, the answers go out in launch order, and a step
that fails at launch or while its tokens are read is answered as that step's error."""

from __future__ import annotations

import pickle
import threading
from multiprocessing import Pipe

from raymoe.actors.step_channel import serve_steps


class _Launched:
    """A launched step whose ``result()`` blocks until the test releases it (the token copy's event)."""

    def __init__(self, batch: str):
        self.batch = batch
        self.released = threading.Event()

    def result(self):
        assert self.released.wait(30), "never released"
        if self.batch == "bad copy":
            raise RuntimeError("copy failed")
        return f"tokens of {self.batch}"


def test_the_next_step_launches_before_this_one_is_answered_and_answers_keep_their_order():
    driver, rank = Pipe()
    launched: list[_Launched] = []
    second_launched = threading.Event()

    def launch(batch: str) -> _Launched:
        if batch == "bad launch":
            raise ValueError("bad batch")
        launched.append(_Launched(batch))
        if len(launched) == 2:
            second_launched.set()
        return launched[-1]

    server = threading.Thread(target=serve_steps, args=(rank, 0, 1, launch, True), daemon=True)
    server.start()
    for seq, batch in enumerate(["a", "b", "bad launch", "bad copy"]):
        driver.send_bytes(pickle.dumps((seq, batch)))
    assert second_launched.wait(30)          # step 1 launched while step 0's result is held back
    assert not driver.poll(0.2)               # ... and nothing was answered yet
    launched[1].released.set()                # step 1's copy lands first: still answered after step 0
    assert not driver.poll(0.2)
    launched[0].released.set()
    assert driver.recv() == (0, "ok", "tokens of a")
    assert driver.recv() == (1, "ok", "tokens of b")
    assert driver.recv() == (2, "error", "ValueError", "bad batch")
    launched[2].released.set()
    assert driver.recv() == (3, "error", "RuntimeError", "copy failed")
    driver.close()
    server.join(30)
    assert not server.is_alive()


def test_a_rank_that_answers_no_tokens_still_waits_for_them():
    driver, rank = Pipe()
    step = _Launched("a")
    server = threading.Thread(target=serve_steps, args=(rank, 1, 2, lambda batch: step, True), daemon=True)
    server.start()  # rank 1 of tp=2: answers without the output, after the step completed
    driver.send_bytes(pickle.dumps((0, "a")))
    assert not driver.poll(0.2)
    step.released.set()
    assert driver.recv() == (0, "ok", None)
    driver.close()
    server.join(30)
