"""``raymoe bench eplb``: expert-parallel load balancing on a skewed router, one run, three engines.

On a checkpoint whose routers send most tokens to a few experts (``raymoe make-checkpoint --router-skew S``), the
same greedy requests run through a dp x ep engine (offline ``Engine`` over Ray rank actors, the serving engine's
driver and ranks without the HTTP front end) three times:

* ``off``: one slot per expert, the load only recorded;
* ``redundant``: ``ep_num_redundant_experts`` extra slots placed at start from the load ``off`` recorded
  (``init_expert_location``: DeepSeek's EPLB placement, static);
* ``dynamic``: the trivial placement with ``enable_eplb``: rebalanced every ``--rebalance-every`` steps while
  serving, weights moved between ranks in the background.

For each: throughput (output tokens / s of the last of ``--waves`` timed waves of the same requests, so ``dynamic``
is measured after the rebalances its first waves drove; every wave's figure is kept), the ranks' decode and
extend step times (the slowest DP group's forward + sampling, expert moves included), the per-layer balance of the
last window (mean / max of per-rank load), and for ``dynamic`` the decode steps while a rebalance moved weights
(longest and median) against the steady decode steps. A benchmark: it prints and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path


def add_eplb_args(p: argparse.ArgumentParser) -> None:
    """The options of ``raymoe bench eplb``."""
    p.add_argument("--model", default=None, help="a skewed checkpoint (default: build one with --router-skew)")
    p.add_argument("--arch", default="qwen3_moe", help="architecture of the checkpoint built when --model is absent")
    p.add_argument("--router-skew", type=float, default=1.0)
    p.add_argument("--dp", type=int, default=2, help="DP groups = EP ranks")
    p.add_argument("--redundant", type=int, default=2, help="ep_num_redundant_experts of redundant and dynamic")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rebalance-every", type=int, default=40, help="eplb_rebalance_num_iterations of dynamic")
    p.add_argument("--waves", type=int, default=3,
                   help="timed waves of the same requests per engine; the last one's throughput is reported (dynamic "
                        "rebalances during the first ones)")
    p.add_argument("--transfer-experts-per-step", type=int, default=1,
                   help="eplb_transfer_experts_per_step of dynamic (expert copies a rank sends or receives per step)")
    p.add_argument("--transfer-pieces", type=int, default=4,
                   help="eplb_transfer_pieces_per_expert of dynamic (each expert copy in this many steps at least)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default="bench_results/eplb.json")


def bench_model(arch: str, skew: float, seed: int) -> str:
    """A skewed checkpoint with experts large enough that expert GEMMs dominate a CPU step (cached)."""
    from raymoe.models.checkpoint import make_checkpoint
    from raymoe.paths import cache_dir

    path = cache_dir() / "bench" / f"eplb-{arch}-skew{skew:g}-s{seed}"
    if not (path / "config.json").exists():
        make_checkpoint(arch, path, seed=seed, num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                        head_dim=64, moe_intermediate_size=512, intermediate_size=512, vocab_size=1024,
                        num_experts=16, num_experts_per_tok=2, router_skew=skew)
    return str(path)


class _StepClock:
    """Every collected step: its mode (``decode``, ``mixed``, ``extend``), the ranks' time for it (the slowest DP
    group's tp-rank 0, from the step's start on the rank, expert moves included, to its tokens on the host,
    seconds) and whether a rebalance was moving weights (decided between its decision and its collection)."""

    def __init__(self, driver):
        self.steps: list[tuple[str, float, bool]] = []
        timer, eplb = driver.step_timer, driver.eplb
        inner = timer.collected

        def collected(mode: str, launched_at: float, forward_seconds: float) -> float:
            commits = eplb.num_layer_commits if eplb is not None else 0
            self.steps.append((mode, forward_seconds, eplb is not None and (eplb.moving or commits != self._commits)))
            self.commit_steps.append(commits != self._commits)
            self._commits = commits
            return inner(mode, launched_at, forward_seconds)

        self.commit_steps: list[bool] = []  # a layer commit was decided since the previous collection

        self._commits = eplb.num_layer_commits if eplb is not None else 0
        timer.collected = collected

    def decode(self, moving: bool) -> list[float]:
        """Forward seconds of the decode steps with / without weights moving."""
        return [s for mode, s, m in self.steps if mode == "decode" and m == moving]


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000 if s else 0.0


def _run_config(name: str, model: str, prompts: list[list[int]], a: argparse.Namespace, **options) -> dict:
    from raymoe import Engine, SamplingParams

    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    with Engine(model, dp_size=a.dp, ep_size=a.dp, max_running_requests=max(8, a.num_prompts // a.dp),
                enable_expert_distribution_metrics=True, eplb_record_interval=4, eplb_window_steps=400,
                **options) as engine:
        engine.generate(prompt_token_ids=prompts[: a.dp * 2], sampling_params=params)  # warm-up
        clock = _StepClock(engine.driver)
        eplb = engine.driver.eplb
        waves = []
        for _ in range(a.waves):  # dynamic: the first wave's load drives rebalances the next waves run on
            t0 = time.perf_counter()
            outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
            waves.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
        report = eplb.report()
        commits = eplb.num_layer_commits
    decode = clock.decode(False)
    row = {"config": name, "tokens_per_s": waves[-1], "waves_tokens_per_s": waves,
           "decode_p50_ms": _pct(decode, 0.5), "decode_p99_ms": _pct(decode, 0.99),
           "extend_p50_ms": _pct([s for mode, s, _ in clock.steps if mode != "decode"], 0.5),
           "balance": report.balance, "mean_balance": statistics.fmean(report.balance),
           "rebalances": report.num_rebalances, "layer_commits": commits, "expert_load": report.expert_load}
    moving = clock.decode(True)
    commit = [s for (mode, s, _), c in zip(clock.steps, clock.commit_steps, strict=True) if mode == "decode" and c]
    if commit:
        row.update(decode_steps_near_commit=len(commit), median_near_commit_ms=_pct(commit, 0.5))
    if moving:
        row.update(decode_steps_moving=len(moving), longest_moving_ms=max(moving) * 1000,
                   median_moving_ms=_pct(moving, 0.5), longest_steady_ms=max(decode, default=0.0) * 1000,
                   longest_over_median=max(moving) / max(statistics.median(decode or moving), 1e-9))
    return row


def run_eplb_bench(a: argparse.Namespace) -> dict:
    """Run the three configurations (module docstring), print the table and write ``--output-json``."""
    model = a.model or bench_model(a.arch, a.router_skew, a.seed)
    from raymoe.config import ModelConfig

    vocab = ModelConfig.from_hf(model).vocab_size
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(vocab) for _ in range(a.input_len)] for _ in range(a.num_prompts)]
    rows = [_run_config("off", model, prompts, a)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"num_logical_experts": len(rows[0]["expert_load"][0]), "expert_load": rows[0]["expert_load"]}, f)
    rows.append(_run_config("redundant", model, prompts, a, ep_num_redundant_experts=a.redundant,
                            init_expert_location=f.name))
    rows.append(_run_config("dynamic", model, prompts, a, ep_num_redundant_experts=a.redundant, enable_eplb=True,
                            eplb_rebalance_num_iterations=a.rebalance_every, eplb_min_window_tokens=64,
                            eplb_transfer_experts_per_step=a.transfer_experts_per_step,
                            eplb_transfer_pieces_per_expert=a.transfer_pieces))
    Path(f.name).unlink()
    base = rows[0]["tokens_per_s"]
    print(f"raymoe bench eplb: {model}, dp=ep={a.dp}, {a.num_prompts} prompts x {a.input_len} in / "
          f"{a.output_len} out, redundant={a.redundant}")
    print("tok/s: the last wave; decode/extend: the ranks' step time, ms (decode steps while no weights moved)")
    print(f"{'config':<10} {'tok/s':>8} {'x off':>6} {'dec p50':>8} {'dec p99':>8} {'ext p50':>8} "
          f"{'balance/layer':<28} commits  waves tok/s")
    for r in rows:
        bal = " ".join(f"{b:.2f}" for b in r["balance"])
        print(f"{r['config']:<10} {r['tokens_per_s']:8.1f} {r['tokens_per_s'] / base:6.2f} {r['decode_p50_ms']:8.2f} "
              f"{r['decode_p99_ms']:8.2f} {r['extend_p50_ms']:8.1f} {bal:<28} {r['layer_commits']:7d}  "
              + " ".join(f"{w:.0f}" for w in r["waves_tokens_per_s"]))
    dyn = rows[2]
    if "longest_moving_ms" in dyn:
        print(f"dynamic: {dyn['decode_steps_moving']} decode steps while weights moved: median "
              f"{dyn['median_moving_ms']:.2f} ms, longest {dyn['longest_moving_ms']:.2f} ms = "
              f"{dyn['longest_over_median']:.2f}x the median steady decode step; longest steady decode step "
              f"{dyn['longest_steady_ms']:.2f} ms; decode steps collected right after a layer switch was decided: "
              f"{dyn.get('decode_steps_near_commit', 0)}, median {dyn.get('median_near_commit_ms', 0.0):.2f} ms")
    result = {"model": model, "dp": a.dp, "rows": [{k: v for k, v in r.items() if k != "expert_load"}
                                                  for r in rows]}
    out = Path(a.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result
