"""No host sync in a decode step: a CUDA rank's launch of a decode step never waits for its device.

The runner's ``launch_step`` (prepare, forward, sample, start the token copy) runs here with the CUDA platform's
code on CPU tensors: the reference operations (what ``CudaPlatform`` inherits), its host copy and TBO streams over
the strict stream double (``tests/cuda_stream_double.py``) and decode "graphs" recorded as on CPU. Every launch is
inside ``HostSyncGuard(device=...)``, which raises at the first device value read on the host (``.item()``,
``.tolist()``, ``bool(tensor)`` ...) and at a blocking host<->device copy. Covered: eager and graph-replayed
decode, with and without two-batch overlap, rows that are greedy, tempered, filtered (top-k, top-p, min-p),
seeded and asking for log-probs. The tokens must equal those of the same steps on the reference platform with
no guard, and the seeded rows must not depend on the batch.

If someone adds ``.item()``, ``.tolist()`` or ``bool(tensor)`` anywhere in that path, these tests fail.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from cuda_stream_double import CudaStreamDouble  # noqa: E402

from raymoe.comm.a2a_plan import apply_dispatch_plan  # noqa: E402
from raymoe.config import GraphConfig, OverlapConfig  # noqa: E402
from raymoe.platform.cuda.platform import CudaPlatform  # noqa: E402
from raymoe.platform.reference.experts import ExpertOps  # noqa: E402
from raymoe.platform.reference.graphs import RecordingCapture  # noqa: E402
from raymoe.platform.reference.sync_guard import HostSyncError, HostSyncGuard  # noqa: E402
from raymoe.platform.selector import reference_platform  # noqa: E402
from raymoe.runner.graph_buckets import apply_graph_plan  # noqa: E402
from raymoe.runner.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from raymoe.step.forward_mode import ForwardMode  # noqa: E402
from raymoe.step.host_transfer import to_device  # noqa: E402
from raymoe.step.logit_penalties import LogitPenalties  # noqa: E402
from raymoe.step.sampling_inputs import SamplingInputs, SamplingRow  # noqa: E402
from raymoe.step.worker_batch import ModelWorkerBatch  # noqa: E402

CTX = 32
ROWS = 4
SIZES = (2, 4)


class CudaOnCpu(CudaPlatform):
    """The CUDA platform's code over the stream double; decode graphs recorded as on CPU (a CUDA graph needs a
    GPU), so a replay runs the same host code as a CUDA replay: buffer refresh, metadata, the recorded forward."""

    def graph_capture(self, device: torch.device):
        return RecordingCapture()

    # The experts' grouped GEMM as on a GPU whose CUTLASS path takes the rows (torch's own grouped GEMM on CPU; the
    # CUDA platform's grouped GEMM refuses CPU tensors and would send the rows to the per-slot fallback).
    grouped_ok = ExpertOps.grouped_ok
    grouped_mlp = ExpertOps.grouped_mlp


def _sampling(rows: list[int], step: int) -> SamplingInputs:
    """Per row: greedy, tempered + seeded + 2 log-probs, top-k/top-p, min-p + seeded + the chosen log-prob."""
    kinds = [dict(t=0.0, k=-1, p=1.0, m=0.0, seed=None, lp=None), dict(t=0.8, k=-1, p=1.0, m=0.0, seed=7, lp=2),
             dict(t=1.0, k=5, p=0.9, m=0.0, seed=None, lp=None), dict(t=0.7, k=-1, p=1.0, m=0.05, seed=11, lp=0)]
    ks = [kinds[r % 4] for r in rows]
    return SamplingInputs(temperatures=[k["t"] for k in ks], top_ps=[k["p"] for k in ks], top_ks=[k["k"] for k in ks],
                          min_ps=[k["m"] for k in ks], seeds=[k["seed"] for k in ks], output_lens=[step] * len(rows),
                          logprobs=[k["lp"] for k in ks])


def _prefill(rows: list[int]) -> ModelWorkerBatch:
    n = 5
    ids = [(13 * r + 3 * i) % 1900 + 10 for r in rows for i in range(n)]
    loc = [1 + r * CTX + i for r in rows for i in range(n)]
    # odd rows: penalties and a logit bias (raymoe.runner.penalties), applied and counted in every decode step, and
    # min_tokens (stop ids masked in the first decode steps, not in the last)
    penalties = LogitPenalties(presence=0.3, frequency=0.5, repetition=1.2, bias=((10, 1.0), (77, -2.0)),
                               prompt_ids=tuple(ids[:n]), min_tokens=3, stop_ids=(0, 2))
    admitted = tuple((i, SamplingRow(0.0, 1.0, -1, 0.0, None, None, n, penalties)) for i, r in enumerate(rows) if r % 2)
    return ModelWorkerBatch(ForwardMode.EXTEND, ids, list(rows), [n] * len(rows), [0] * len(rows), [n] * len(rows),
                            loc, sampling=SamplingInputs.greedy(len(rows)), sampling_rows=admitted)


def _decode(rows: list[int], step: int, prev: list[int], tbo: bool, graphs: bool) -> ModelWorkerBatch:
    """Decode ``step`` of ``rows`` fed the previous step's tokens, planned as the driver plans it (graph bucket,
    low-latency capacity: CUDA keeps decode in the fixed-shape mode)."""
    lens = [5 + step + 1] * len(rows)
    batch = ModelWorkerBatch(ForwardMode.DECODE, list(prev), list(rows), lens, [n - 1 for n in lens], [1] * len(rows),
                             [1 + r * CTX + n - 1 for r, n in zip(rows, lens, strict=True)],
                             sampling=_sampling(rows, step), use_tbo=tbo)
    batches = apply_graph_plan([batch], SIZES) if graphs else [batch]
    return apply_dispatch_plan(batches, "auto", ROWS)[0]


def _runner(path: str, ops, tbo: bool, graphs: bool) -> ModelRunner:
    cfg = RunnerConfig(path, "float32", num_kv_slots=ROWS * CTX, max_req_rows=ROWS, max_context_len=CTX,
                       graph=GraphConfig(disable_cuda_graph=not graphs, cuda_graph_bs=SIZES),
                       overlap=OverlapConfig(enable_tbo=tbo, tbo_min_tokens_decode=2))
    return ModelRunner(cfg, ops=ops)


def _run(runner: ModelRunner, tbo: bool, graphs: bool, guard) -> list[tuple[list[int], list]]:
    """A prefill, then three decode steps launched under ``guard()`` and answered after it."""
    rows = [0, 1, 2, 3]
    answers = [runner.forward_batch_generation(_prefill(rows))]
    prev = answers[0].next_token_ids
    out = []
    for step in range(3):
        batch = _decode(rows, step, prev, tbo, graphs)
        with guard():
            pending = runner.launch_step(batch)
        answer = pending.result()
        out.append((answer.next_token_ids, answer.logprobs))
        prev = answer.next_token_ids
    return out


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("tbo", [False, True], ids=["plain", "tbo"])
def test_decode_step_launches_without_a_host_sync(tiny_model, tbo, graphs):
    double = CudaStreamDouble(scratch_row0=lambda t: t.shape[0] == ROWS * CTX + 1)  # KV pools: dummy slot 0
    with double:  # graph capture included: a captured TBO forward forks and joins the second stream too
        cuda_runner = _runner(tiny_model, CudaOnCpu(cuda_api=double), tbo, graphs)
        got = _run(cuda_runner, tbo, graphs, lambda: HostSyncGuard(device=cuda_runner.device))
    double.check()
    expected = _run(_runner(tiny_model, reference_platform(), tbo, graphs), tbo, graphs, _Nothing)
    assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    for (_, lp_got), (_, lp_exp) in zip(got, expected, strict=True):
        assert [lp is None for lp in lp_got] == [lp is None for lp in lp_exp] == [True, False, True, False]
        assert [len(lp.top_token_ids) for lp in lp_got if lp] == [2, 0]
        for a, b in zip(lp_got, lp_exp, strict=True):
            if a is not None:
                assert a.top_token_ids == b.top_token_ids and abs(a.logprob - b.logprob) < 1e-5
    on_second = {s for _, s in double.log} - {"default"}
    assert bool(on_second) == tbo, f"ops ran on {on_second or 'the default stream only'}"


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def test_the_step_guard_refuses_blocking_copies_and_allows_their_replacements():
    guard = HostSyncGuard(device="cpu")
    t = torch.arange(4)
    refused = [lambda: torch.tensor([1, 2], device="cpu"), lambda: torch.as_tensor([1.0], device=torch.device("cpu")),
               lambda: t.cpu(), lambda: t.to("cpu"), lambda: t.to(device="cpu", dtype=torch.float32),
               lambda: t.tolist(), lambda: t.sum().item(), lambda: bool(t.any()), lambda: int(t[0])]
    for call in refused:
        with pytest.raises(HostSyncError), guard:
            call()
    with guard:
        assert to_device([1, 2], torch.int64, "cpu").shape == (2,)
        t.to("cpu", non_blocking=True)
        torch.tensor([1, 2])           # a host tensor: no device named
    with HostSyncGuard():              # without a device: only what a CUDA graph cannot hold
        t.cpu()
        torch.tensor([1], device="cpu")


def test_a_sync_added_to_the_decode_step_fails_it(tiny_model):
    """What a regression looks like: the sampler of the decode step made to read one device value on the host
    (``.item()``, ``.tolist()``, ``bool(tensor)``); unguarded, the same step runs."""
    runner = _runner(tiny_model, CudaOnCpu(cuda_api=CudaStreamDouble()), tbo=False, graphs=False)
    prev = runner.forward_batch_generation(_prefill([0, 1, 2, 3])).next_token_ids
    sample = runner.sampler.sample
    reads = {"item": lambda lg: lg[0, 0].item(), "tolist": lambda lg: lg.argmax(-1).tolist(),
             "bool": lambda lg: bool((lg > 0).any())}
    for added, read in reads.items():
        runner.sampler.sample = lambda logits, info, read=read, **kw: (read(logits), sample(logits, info, **kw))[1]
        batch = _decode([0, 1, 2, 3], 0, prev, tbo=False, graphs=False)
        try:
            with HostSyncGuard(device=runner.device):
                runner.launch_step(batch)
        except HostSyncError:
            pass
        else:
            pytest.fail(f"a {added} in the decode step went unnoticed")
        runner.launch_step(batch).result()  # unguarded, the step runs
