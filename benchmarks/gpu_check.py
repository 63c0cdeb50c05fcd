"""One GPU check: everything a one-GPU machine can tell about raymoe, in under 8 minutes, as one summary table.

Run from the repository root (raymoe need not be installed; Ray is not needed, and its absence is reported)::

    python benchmarks/gpu_check.py                 # on a CUDA machine
    python benchmarks/gpu_check.py --dry-run       # here, on CPU: the same steps at toy sizes (the plumbing)

Steps, in order, each a subprocess with its own time limit cut to what is left of the budget (``--budget-s``,
default 480 s); a step that cannot start in what is left is skipped and says so:

1. ``env``: ``raymoe env`` (torch, CUDA, NCCL, which GPU backends import).
2. ``gpu-tests``: ``pytest -m gpu tests/gpu`` (CUDA parity, graphs, bf16; skipped tests are counted).
3. ``graph``: ``raymoe bench graph`` in bf16: eager vs CUDA-graph decode step per bucket, same tokens or not.
4. ``offline``: ``raymoe bench offline`` in bf16 against transformers ``generate`` on the same GPU (tok/s ratio).
5. ``serve``: ``raymoe serve`` on the GPU (dp=1), one chat completion through the OpenAI API, then stopped;
   needs Ray (``raymoe serve`` runs on Ray Serve): without it the step is skipped with that reason.

Without CUDA (and without ``--dry-run``) the GPU steps are skipped with the reason. ``--dry-run`` runs every step
on CPU at toy sizes so the plumbing (commands, parsing, budget, table) is exercised anywhere; ``--steps`` picks a
subset. The table is printed at the end, and written as JSON with ``--output-json``. Exit status: 1 if any step
failed, else 0 (skips are not failures).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("env", "gpu-tests", "graph", "offline", "serve")
CAPS_S = {"env": 60, "gpu-tests": 240, "graph": 90, "offline": 150, "serve": 150}
"""Each step's own time limit, seconds (the budget cuts it further)."""


@dataclass
class StepResult:
    """One row of the summary: ``status`` is ok, failed or skipped; ``detail`` the figures, or why."""

    step: str
    status: str
    seconds: float
    detail: str


def _run(argv: list[str], timeout_s: float, env: dict) -> tuple[int, str]:
    """Run ``argv`` from the repository root; (exit code, stdout+stderr). Exit 124 on timeout."""
    try:
        p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        return 124, out.decode(errors="replace") if isinstance(out, bytes) else out


def _tail(text: str, n: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:])


def check_env(cfg, timeout_s: float) -> StepResult:
    rc, out = _run([sys.executable, "-m", "raymoe.cli", "env"], timeout_s, cfg.env)
    if rc != 0:
        return StepResult("env", "failed", 0, _tail(out))
    fields = dict(re.findall(r"^(\S+)\s+(.*)$", out, re.M))
    keys = ("torch", "cuda.device0", "nccl.version", "attention_backend=flash_attn", "a2a_backend=deepep", "ray")
    return StepResult("env", "ok", 0, "; ".join(f"{k} {fields[k]}" for k in keys if k in fields))


def check_gpu_tests(cfg, timeout_s: float) -> StepResult:
    rc, out = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/gpu"],
                   timeout_s, cfg.env)
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", out))
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or _tail(out)
    if rc not in (0, 5) or counts.get("failed") or counts.get("error") or counts.get("errors"):
        return StepResult("gpu-tests", "failed", 0, summary)
    if not cfg.cuda and not counts.get("passed"):
        summary += " (no CUDA: every GPU test skips)"
    return StepResult("gpu-tests", "ok", 0, summary)


def check_graph(cfg, timeout_s: float) -> StepResult:
    out_json = Path(cfg.tmp) / "graph.json"
    sizes, iters = ("1,8,32,64", "20") if not cfg.dry_run else ("1,2", "2")
    rc, out = _run([sys.executable, "-m", "raymoe.cli", "bench", "graph", "--device", cfg.device, "--dtype",
                    cfg.dtype, "--batch-sizes", sizes, "--iters", iters, "--warmup", "1", "--seq-len", "32",
                    "--max-context-len", "64", "--output-json", str(out_json)], timeout_s, cfg.env)
    if rc != 0 or not out_json.exists():
        return StepResult("graph", "failed", 0, _tail(out))
    variant = json.loads(out_json.read_text())["variants"]["static"]
    rows = variant["rows"]
    same = all(r["same_tokens"] for r in rows)
    speed = ", ".join(f"bs{r['batch_size']} {r['eager_ms']:.2f}->{r['graph_ms']:.2f} ms" for r in rows)
    detail = f"{cfg.dtype}, capture {variant['capture_seconds']:.2f} s; {speed}; same tokens: {same}"
    return StepResult("graph", "ok" if same else "failed", 0, detail)


def check_offline(cfg, timeout_s: float) -> StepResult:
    out_json = Path(cfg.tmp) / "offline.json"
    n, inp, outp, reps = ("128", "32", "64", "2") if not cfg.dry_run else ("4", "8", "4", "1")
    rc, out = _run([sys.executable, "-m", "raymoe.cli", "bench", "offline", "--device", cfg.device, "--dtype",
                    cfg.dtype, "--skip-peer", "--num-prompts", n, "--input-len", inp, "--output-len", outp,
                    "--repeats", reps, "--decode-batches", "", "--output-json", str(out_json)], timeout_s, cfg.env)
    if rc != 0 or not out_json.exists():
        return StepResult("offline", "failed", 0, _tail(out))
    results = json.loads(out_json.read_text())["results"]
    ours = results[0]["output_tok_per_s"]
    hf = next((r for r in results[1:] if "raymoe_ratio" in r), None)
    detail = f"{cfg.dtype}: raymoe {ours:,.0f} tok/s"
    if hf is not None:
        detail += f", transformers {hf['output_tok_per_s']:,.0f} tok/s, ratio {hf['raymoe_ratio']:.2f}x"
    return StepResult("offline", "ok", 0, detail)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_json(url: str, body: dict | None = None, timeout: float = 10.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def check_serve(cfg, timeout_s: float) -> StepResult:
    port = _free_port()
    log = Path(cfg.tmp) / "serve.log"
    argv = [sys.executable, "-m", "raymoe.cli", "serve", "--device", cfg.device, "--dtype", cfg.dtype, "--dp", "1",
            "--ep", "1", "--tp", "1", "--port", str(port)]
    deadline = time.monotonic() + timeout_s
    with open(log, "w") as f:
        server = subprocess.Popen(argv, cwd=ROOT, env=cfg.env, stdout=f, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        while True:
            if server.poll() is not None:
                return StepResult("serve", "failed", 0, f"server exited {server.returncode}: "
                                                        f"{_tail(log.read_text())}")
            if time.monotonic() > deadline:
                return StepResult("serve", "failed", 0, f"not ready in {timeout_s:.0f} s: {_tail(log.read_text())}")
            try:
                model = _http_json(f"{base}/models", timeout=2)["data"][0]["id"]
                break
            except OSError:
                time.sleep(1)
        answer = _http_json(f"{base}/chat/completions", {"model": model, "max_tokens": 8, "temperature": 0,
                                                         "messages": [{"role": "user", "content": "Hello"}]},
                            timeout=max(5.0, deadline - time.monotonic()))
        usage = answer["usage"]["completion_tokens"]
        ok = usage > 0 and answer["choices"][0]["finish_reason"] in ("stop", "length")
        return StepResult("serve", "ok" if ok else "failed", 0,
                          f"dp=1 on {cfg.device}, {cfg.dtype}: one chat completion, {usage} tokens, "
                          f"finish_reason {answer['choices'][0]['finish_reason']}")
    finally:
        os.killpg(server.pid, signal.SIGINT)  # the server's own process group (start_new_session)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


CHECKS = {"env": check_env, "gpu-tests": check_gpu_tests, "graph": check_graph, "offline": check_offline,
          "serve": check_serve}


def skip_reason(step: str, cfg) -> str | None:
    """Why ``step`` cannot run on this machine, or None."""
    if step in ("graph", "offline", "serve") and not cfg.cuda and not cfg.dry_run:
        return "no CUDA device visible to torch"
    if step == "serve" and not cfg.has_ray:
        return "Ray is not installed: raymoe serve runs on Ray Serve (pip install 'ray[serve]')"
    if step == "serve" and cfg.dry_run and not cfg.serve_on_cpu:
        return "dry run: a served engine starts Ray (about a minute on CPU); --serve-on-cpu runs it"
    return None


def run_checks(cfg) -> list[StepResult]:
    """Run ``cfg.steps`` in order within ``cfg.budget_s``; one :class:`StepResult` per step."""
    start = time.monotonic()
    results = []
    for step in cfg.steps:
        reason = skip_reason(step, cfg)
        left = cfg.budget_s - (time.monotonic() - start)
        if reason is None and left < 10:
            reason = f"budget of {cfg.budget_s:.0f} s spent"
        if reason is not None:
            results.append(StepResult(step, "skipped", 0.0, reason))
            continue
        t0 = time.monotonic()
        try:
            result = CHECKS[step](cfg, min(CAPS_S[step], left))
        except Exception as e:  # noqa: BLE001 - one step's failure is a row of the table, the rest still run
            result = StepResult(step, "failed", 0, f"{type(e).__name__}: {e}")
        result.seconds = round(time.monotonic() - t0, 1)
        results.append(result)
    return results


def format_table(results: list[StepResult], header: str) -> str:
    """The summary: one markdown row per step."""
    lines = [header, "", "| step | status | s | result, or why skipped |", "|---|---|---:|---|"]
    lines += [f"| {r.step} | {r.status} | {r.seconds:.1f} | {r.detail} |" for r in results]
    return "\n".join(lines)


def _config(a: argparse.Namespace):
    import torch  # after argument parsing: --help needs no torch

    cuda = torch.cuda.is_available()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    steps = tuple(s.strip() for s in a.steps.split(",") if s.strip())
    unknown = set(steps) - set(STEPS)
    if unknown:
        raise SystemExit(f"unknown steps {sorted(unknown)}; choose from {', '.join(STEPS)}")
    return argparse.Namespace(
        cuda=cuda, dry_run=a.dry_run, device="cpu" if a.dry_run else "cuda",
        dtype="float32" if a.dry_run else "bfloat16", steps=steps, budget_s=a.budget_s, env=env,
        has_ray=importlib.util.find_spec("ray") is not None, serve_on_cpu=a.serve_on_cpu,
        tmp=tempfile.mkdtemp(prefix="raymoe-gpu-check-"), torch=torch.__version__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="run every step on CPU at toy sizes (the plumbing)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of all steps, seconds")
    p.add_argument("--serve-on-cpu", action="store_true", help="with --dry-run, also run the served smoke test")
    p.add_argument("--output-json", default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    cfg = _config(a)
    t0 = time.monotonic()
    results = run_checks(cfg)
    mode = "dry run on CPU" if cfg.dry_run else ("CUDA" if cfg.cuda else "no CUDA")
    print(format_table(results, f"raymoe GPU check ({mode}, torch {cfg.torch}, "
                                f"{time.monotonic() - t0:.0f} s of a {cfg.budget_s:.0f} s budget)"))
    if a.output_json:
        Path(a.output_json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
