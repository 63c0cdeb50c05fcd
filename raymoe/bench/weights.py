"""What ``raymoe bench offline`` reports about weights: a rank's resident weight bytes, and for an FP8 checkpoint the
unquantized checkpoint of the same seed to run beside it.

The unquantized twin of a folder written by ``raymoe make-checkpoint --quant fp8`` is rebuilt from its
``raymoe_build.json`` (the same builder arguments and seed, no ``quant``) once per cache folder; any other FP8
checkpoint needs ``--baseline-model``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from raymoe.errors import InvalidRequestError

_SPEC_FIELDS = ("num_layers", "hidden_size", "num_experts", "num_experts_per_tok", "num_heads", "num_kv_heads",
                "head_dim", "moe_intermediate_size", "intermediate_size", "vocab_size", "max_position_embeddings",
                "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "tie_word_embeddings", "router_skew")


def unquantized_twin(model: str | Path) -> Path:
    """The unquantized checkpoint built with ``model``'s ``raymoe_build.json`` arguments (same seed), under
    ``cache_dir()`` (built on first use, file-locked).

    Raises:
        InvalidRequestError: ``model`` has no ``raymoe_build.json`` (not built by ``make-checkpoint``).
    """
    from filelock import FileLock

    from raymoe.models.checkpoint import make_checkpoint
    from raymoe.paths import cache_dir

    build = Path(model) / "raymoe_build.json"
    if not build.is_file():
        raise InvalidRequestError("baseline_model", f"{model} was not built by raymoe make-checkpoint; pass "
                                  "--baseline-model with its unquantized checkpoint")
    args = json.loads(build.read_text())
    spec = {k: (tuple(args[k]) if k == "mlp_only_layers" else args[k]) for k in _SPEC_FIELDS if k in args}
    name = "-".join(f"{k}{v}" for k, v in sorted(spec.items())).replace(" ", "")
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    out = cache_dir() / f"unquantized-{args['arch']}-seed{args['seed']}-{digest}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "config.json").is_file():
            make_checkpoint(args["arch"], out, seed=args["seed"], **spec)
    return out


def resident_weight_bytes(engine) -> int | None:
    """Bytes of the model weights resident on an offline engine's in-process rank (``ModelRunner.weight_bytes``);
    None where the ranks are Ray actors (tp * dp > 1)."""
    worker = getattr(engine.driver.executor, "worker", None)
    runner = getattr(worker, "runner", None)
    return None if runner is None else runner.weight_bytes()
