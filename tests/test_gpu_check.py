"""The one-GPU check script (``benchmarks/gpu_check.py``), in its CPU dry mode: steps run as subprocesses, their
output is parsed into one summary table, steps that cannot run say why, the budget is kept and a failing step
makes the exit status 1 without stopping the others."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)  # dataclasses look the module up
_spec.loader.exec_module(gpu_check)


def _cfg(tmp_path, **overrides) -> argparse.Namespace:
    args = argparse.Namespace(dry_run=True, steps="env,serve", budget_s=480.0, serve_on_cpu=False)
    cfg = gpu_check._config(args)
    cfg.tmp = str(tmp_path)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def test_dry_run_reports_the_environment_and_says_why_serving_is_skipped(tmp_path, capsys):
    results = gpu_check.run_checks(_cfg(tmp_path, has_ray=False))
    assert [(r.step, r.status) for r in results] == [("env", "ok"), ("serve", "skipped")]
    assert "torch 2." in results[0].detail and "a2a_backend=deepep" in results[0].detail
    assert "Ray is not installed" in results[1].detail
    table = gpu_check.format_table(results, "title")
    assert table.splitlines()[2] == "| step | status | s | result, or why skipped |"
    assert "| serve | skipped | 0.0 | Ray is not installed" in table


def test_without_cuda_the_gpu_steps_are_skipped_and_a_spent_budget_skips_the_rest(tmp_path):
    cfg = _cfg(tmp_path, dry_run=False, cuda=False, steps=("graph", "offline", "serve"))
    assert {r.detail for r in gpu_check.run_checks(cfg)} == {"no CUDA device visible to torch"}
    cfg = _cfg(tmp_path, budget_s=5.0, steps=gpu_check.STEPS)
    assert {(r.status, r.detail) for r in gpu_check.run_checks(cfg) if r.step != "serve"} == {
        ("skipped", "budget of 5 s spent")}


def test_a_failing_step_is_a_row_and_the_exit_status(tmp_path, monkeypatch, capsys):
    def broken(cfg, timeout_s):
        raise RuntimeError("no kernel image is available")

    seen = []
    monkeypatch.setitem(gpu_check.CHECKS, "graph", broken)
    monkeypatch.setitem(gpu_check.CHECKS, "offline",
                        lambda cfg, timeout_s: seen.append(timeout_s) or gpu_check.StepResult("offline", "ok", 0, "x"))
    assert gpu_check.main(["--dry-run", "--steps", "graph,offline", "--budget-s", "100"]) == 1
    out = capsys.readouterr().out
    assert "| graph | failed |" in out and "RuntimeError: no kernel image is available" in out
    assert "| offline | ok |" in out
    assert 0 < seen[0] <= gpu_check.CAPS_S["offline"]
    with pytest.raises(SystemExit, match="unknown steps"):
        gpu_check.main(["--steps", "env,bench"])


_NO_WEB_STACK = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("starlette", "fastapi", "uvicorn", "pydantic", "ray"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
from raymoe.cli import build_parser, main
build_parser().parse_args(["bench", "graph", "--device", "cuda"])
try:
    main(["serve", "--dp", "2"])
except SystemExit as e:
    print("serve:", e)
main(["env"])
"""


def test_the_command_line_runs_without_the_serving_stack():
    """The GPU machine has torch but neither pydantic, the web framework nor Ray; its first run of this check
    failed ``raymoe env``, the graph and the offline benchmarks on ``import starlette``, then on ``import pydantic``
    (the serve flags). With those modules unimportable, the parser builds, ``env`` runs and ``serve`` says what is
    missing."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _NO_WEB_STACK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "serve: raymoe serve needs" in out.stdout and "torch" in out.stdout, out.stdout
