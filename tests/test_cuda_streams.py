"""The CUDA platform's stream and event choreography, on CPU through the strict stream double.

Two-batch overlap on a second stream (``raymoe.platform.cuda.streams.CudaTboStreams`` driven by
``raymoe.overlap.operations.execute_overlapped_operations``): child B's ops run on the second stream, after an event
of the parent's preparation (fork), and the parent waits for an event of the second stream before it reads child
B's outputs (join), which are recorded on the parent stream for the caching allocator. Each rule is shown needed:
the same run with one of them left out is reported by the double. The token copy (``CudaHostCopy``) is read only
after its event, which the double's device never completes on its own.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from cuda_stream_double import CudaStreamDouble, StreamDoubleError  # noqa: E402

from raymoe.overlap.operations import YieldOperation, execute_overlapped_operations  # noqa: E402
from raymoe.platform.cuda.streams import CudaHostCopy, CudaTboStreams  # noqa: E402


def _double_it(state) -> None:
    state.hidden_states = state.hidden_states * 2


def _add_one(state) -> None:
    state.hidden_states = state.hidden_states + 1
    state.residual = state.hidden_states.clone()


OPS = [_double_it, YieldOperation(), _add_one]


def _tbo_step(streams) -> torch.Tensor:
    """The parent prepares [4, 3], the children take two rows each through ``OPS``, the parent concatenates."""
    x = torch.arange(12, dtype=torch.float32).view(4, 3) + 0.5
    states = [SimpleNamespace(hidden_states=x[:2], residual=None), SimpleNamespace(hidden_states=x[2:], residual=None)]
    a, b = execute_overlapped_operations(states, [OPS, OPS], [0, 1], streams)
    return torch.cat([a.hidden_states, b.hidden_states]).sum(dim=1)


class NoForkWait(CudaTboStreams):
    def fork(self) -> None:
        self.parent = self.cuda.current_stream()


class NoJoinWait(CudaTboStreams):
    def join(self, child_outputs) -> None:
        for t in child_outputs:
            t.record_stream(self.parent)
        self.parent = None


class NoRecordStream(CudaTboStreams):
    def join(self, child_outputs) -> None:
        super().join([])


def test_tbo_child_b_runs_on_the_second_stream_between_fork_and_join():
    double = CudaStreamDouble()
    with double:
        out = _tbo_step(CudaTboStreams(double))
    double.check()
    x = torch.arange(12, dtype=torch.float32).view(4, 3) + 0.5
    assert torch.equal(out, (x * 2 + 1).sum(dim=1))
    ops = [(name, stream) for name, stream in double.log if name in ("mul", "add", "clone", "cat")]
    # the parent's preparation; child A (default) stage 0, then A's stage 1 and B's stage 0 (delta 1), then B's
    # stage 1 (on stream1); the parent's cat after the join
    assert ops == [("add", "default"), ("mul", "default"), ("add", "default"), ("clone", "default"), ("mul", "stream1"),
                   ("add", "stream1"), ("clone", "stream1"), ("cat", "default")]


@pytest.mark.parametrize("broken, error", [(NoForkWait, "race (write -> read): mul on stream1 after add on default"),
                                           (NoJoinWait, "race (write -> read): cat on default after add on stream1"),
                                           (NoRecordStream, "freed: a storage allocated on stream1")])
def test_each_rule_of_the_choreography_is_needed(broken, error):
    double = CudaStreamDouble()
    with double:
        out = _tbo_step(broken(double))
        del out
        gc.collect()
    with pytest.raises(StreamDoubleError, match=error.replace("(", r"\(").replace(")", r"\)")):
        double.check()


def test_streams_refuse_use_before_fork():
    streams = CudaTboStreams(CudaStreamDouble())
    with pytest.raises(RuntimeError, match="before fork"):
        streams.child(1)
    with pytest.raises(RuntimeError, match="before fork"):
        streams.join([])


def test_the_token_copy_is_ready_only_after_its_event():
    double = CudaStreamDouble()
    with double:
        ids = torch.arange(4) * 3
        copy = CudaHostCopy([ids], double)
        assert not copy.ready()  # the double's device completes nothing until the host waits
        copy.wait()
        assert copy.ready()
        assert copy.tensors[0].tolist() == [0, 3, 6, 9]
    double.check()
