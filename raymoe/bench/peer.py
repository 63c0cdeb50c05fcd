"""The vLLM-CPU peer of ``raymoe bench offline`` (installed by ``../shared/peers/setup.sh`` under ``/tmp/peers``).

The peer runs in its own virtual environment as a subprocess: ``<peers>/vllm/bin/python <peers>/vllm_offline.py
MODEL`` with the variables of ``<peers>/env.sh`` and ``NPROMPTS``/``OUTLEN``/``MAXSEQS``/``DTYPE``/``EAGER``. The
script generates greedily with EOS ignored and prints one ``GEN repN ... = X tok/s`` line per timed run; the best
run is reported, as for raymoe. Its prompts are short text prompts of its own (about ten tokens), not raymoe's
random token ids: at 128 output tokens the prompt length changes the figure by well under one percent.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

_GEN = re.compile(r"^GEN rep\d+ .*?: (\d+) tokens in ([0-9.]+)s = ([0-9.]+) tok/s", re.MULTILINE)
_STARTUP = re.compile(r"^STARTUP ([0-9.]+)s", re.MULTILINE)


@dataclass(frozen=True)
class PeerMode:
    """One peer configuration: ``dtype`` (``"float32"`` | ``"bfloat16"``) and ``eager`` (False: torch.compile)."""

    dtype: str
    eager: bool

    @property
    def name(self) -> str:
        return f"vllm-cpu[{self.dtype}, {'eager' if self.eager else 'compiled'}]"

    @classmethod
    def parse(cls, text: str) -> "PeerMode":
        """``"float32-eager"`` / ``"bfloat16-compiled"`` -> PeerMode.

        Raises:
            ValueError: not ``<float32|bfloat16>-<eager|compiled>``.
        """
        dtype, _, mode = text.strip().partition("-")
        if dtype not in ("float32", "bfloat16") or mode not in ("eager", "compiled"):
            raise ValueError(f"peer mode must be <float32|bfloat16>-<eager|compiled>, got {text!r}")
        return cls(dtype, mode == "eager")


def peer_missing(peers_dir: str | os.PathLike) -> str | None:
    """Why the peer cannot run (a sentence naming the missing file), or None when it is installed."""
    root = Path(peers_dir)
    for need in (root / "vllm" / "bin" / "python", root / "vllm_offline.py", root / "env.sh"):
        if not need.exists():
            return (f"vLLM-CPU peer not installed ({need} is missing); run `bash ../shared/peers/setup.sh` to "
                    "compare against it")
    return None


def run_peer(peers_dir: str | os.PathLike, model: str, mode: PeerMode, num_prompts: int, output_len: int,
             timeout_s: float = 900.0) -> dict:
    """Run the peer once (start-up, warm-up, three timed runs) and return its figures.

    Returns:
        ``{"engine", "dtype", "eager", "output_tok_per_s" (best run), "seconds", "output_tokens", "runs_tok_per_s",
        "startup_seconds"}``, or ``{"engine", "error"}`` when the peer failed or printed no timed run (the
        error holds the tail of its output).
    """
    root = Path(peers_dir)
    env_vars = (f"NPROMPTS={num_prompts} OUTLEN={output_len} MAXSEQS={num_prompts} DTYPE={mode.dtype} "
                f"EAGER={int(mode.eager)}")
    cmd = (f"source {shlex.quote(str(root / 'env.sh'))} && {env_vars} exec "
           f"{shlex.quote(str(root / 'vllm' / 'bin' / 'python'))} {shlex.quote(str(root / 'vllm_offline.py'))} "
           f"{shlex.quote(model)}")
    try:
        proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout_s)
        text = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        return {"engine": mode.name, "error": f"timed out after {timeout_s:.0f} s: {_tail(e.stdout)}"}
    runs = [(int(n), float(s), float(r)) for n, s, r in _GEN.findall(text)]
    if not runs:
        return {"engine": mode.name, "error": f"exit {proc.returncode}, no timed run: {_tail(text)}"}
    tokens, secs, best = max(runs, key=lambda r: r[2])
    startup = _STARTUP.search(text)
    return {"engine": mode.name, "dtype": mode.dtype, "eager": mode.eager, "output_tok_per_s": best,
            "seconds": secs, "output_tokens": tokens, "runs_tok_per_s": [r[2] for r in runs],
            "startup_seconds": float(startup.group(1)) if startup else None}


def _tail(text: str | bytes | None, chars: int = 600) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-chars:].strip()
