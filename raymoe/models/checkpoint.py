"""Seeded tiny checkpoints: Hugging Face model folders with random weights and a trained tokenizer.

``make_checkpoint`` writes ``config.json``, ``generation_config.json``, the tokenizer files and safetensors weights
under their on-disk Hugging Face names, so the same folder loads in ``transformers`` (the parity oracle) and in
raymoe. Weights are float32 and a pure function of the arguments (one ``torch.Generator`` seeded with ``seed``,
tensors drawn in a fixed order by the builders of ``raymoe.models.tiny_init``, scaled so that greedy decoding is
well conditioned).

``default_model_path`` builds the demo checkpoint once per cache folder (file-locked) and returns its path.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import save_file

from raymoe.errors import InvalidRequestError
from raymoe.models import tiny_archs, tiny_gpt_oss, tiny_qwen3_5
from raymoe.models.fp8_checkpoint import fp8_config, quantize_tensors
from raymoe.models.router_skew import apply_router_skew, check_router_skew
from raymoe.models.tiny_init import LM_HEAD_GAIN, OUT_PROJ_GAIN, ROUTER_GAIN, linear, norm
from raymoe.models.tokenizer_builder import ENDOFTEXT_ID, IM_END_ID, build_tokenizer
from raymoe.paths import cache_dir

DEMO_VERSION = 1
"""Bump when the demo checkpoint's contents change, so caches rebuild under a new folder name."""


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of a tiny checkpoint (element counts; ``head_dim`` per head). See ``make_checkpoint``."""

    num_layers: int = 4
    hidden_size: int = 128
    num_experts: int = 8
    num_experts_per_tok: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    moe_intermediate_size: int = 64
    intermediate_size: int = 256
    vocab_size: int = 2048
    max_position_embeddings: int = 4096
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    sliding_window: int = 16
    mxfp4: bool = False
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_experts", "num_experts_per_tok", "num_heads", "num_kv_heads",
                     "head_dim", "moe_intermediate_size", "intermediate_size", "vocab_size",
                     "max_position_embeddings", "decoder_sparse_step", "sliding_window"):
            if int(getattr(self, name)) < 1:
                raise InvalidRequestError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.mtp_layers not in (0, 1):
            raise InvalidRequestError("mtp_layers", f"must be 0 or 1, got {self.mtp_layers}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidRequestError("num_kv_heads", "num_heads must be a multiple of num_kv_heads")
        if self.num_experts_per_tok > self.num_experts:
            raise InvalidRequestError("num_experts_per_tok", "must be <= num_experts")
        if self.head_dim % 2:
            raise InvalidRequestError("head_dim", "must be even (rotary embedding)")
        if self.mxfp4 and (self.hidden_size % 32 or self.moe_intermediate_size % 32):
            raise InvalidRequestError("mxfp4", "MXFP4 experts need hidden_size and moe_intermediate_size "
                                               "multiples of 32")

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen3-MoE rule: sparse iff not in ``mlp_only_layers`` and ``(layer + 1) % decoder_sparse_step == 0``."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


Tensors = dict[str, torch.Tensor]


class _Arch(NamedTuple):
    hf_config: Callable[[TinyModelSpec], dict[str, Any]]
    weight_steps: Callable[[TinyModelSpec, torch.Generator], Iterator[Tensors]]


def _qwen3_moe_config(s: TinyModelSpec) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "moe_intermediate_size": s.moe_intermediate_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": s.tie_word_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "decoder_sparse_step": s.decoder_sparse_step,
        "mlp_only_layers": list(s.mlp_only_layers),
        "num_experts": s.num_experts,
        "num_experts_per_tok": s.num_experts_per_tok,
        "norm_topk_prob": s.norm_topk_prob,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "dtype": "float32",
    }


def _qwen3_moe_weights(s: TinyModelSpec, gen: torch.Generator) -> Iterator[Tensors]:
    """Yield the weights in build steps: embeddings, one dict per decoder layer, final norm + lm_head."""
    h, d = s.hidden_size, s.head_dim
    yield {"model.embed_tokens.weight": torch.randn(s.vocab_size, h, generator=gen)}
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        t: Tensors = {
            p + "input_layernorm.weight": norm(gen, h),
            p + "self_attn.q_proj.weight": linear(gen, s.num_heads * d, h),
            p + "self_attn.k_proj.weight": linear(gen, s.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": linear(gen, s.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": linear(gen, h, s.num_heads * d, OUT_PROJ_GAIN),
            p + "self_attn.q_norm.weight": norm(gen, d),
            p + "self_attn.k_norm.weight": norm(gen, d),
            p + "post_attention_layernorm.weight": norm(gen, h),
        }
        if s.is_moe_layer(i):
            t[p + "mlp.gate.weight"] = linear(gen, s.num_experts, h, ROUTER_GAIN)
            for e in range(s.num_experts):
                q = f"{p}mlp.experts.{e}."
                t[q + "gate_proj.weight"] = linear(gen, s.moe_intermediate_size, h)
                t[q + "up_proj.weight"] = linear(gen, s.moe_intermediate_size, h)
                t[q + "down_proj.weight"] = linear(gen, h, s.moe_intermediate_size, OUT_PROJ_GAIN)
        else:
            t[p + "mlp.gate_proj.weight"] = linear(gen, s.intermediate_size, h)
            t[p + "mlp.up_proj.weight"] = linear(gen, s.intermediate_size, h)
            t[p + "mlp.down_proj.weight"] = linear(gen, h, s.intermediate_size, OUT_PROJ_GAIN)
        yield t
    last: Tensors = {"model.norm.weight": norm(gen, h)}
    if not s.tie_word_embeddings:
        last["lm_head.weight"] = linear(gen, s.vocab_size, h, LM_HEAD_GAIN)
    yield last


ARCHS: dict[str, _Arch] = {
    "qwen3_moe": _Arch(_qwen3_moe_config, _qwen3_moe_weights),
    "deepseek_v2": _Arch(partial(tiny_archs.deepseek_config, v3=False), partial(tiny_archs.deepseek_weights, v3=False)),
    "deepseek_v3": _Arch(partial(tiny_archs.deepseek_config, v3=True), partial(tiny_archs.deepseek_weights, v3=True)),
    "mixtral": _Arch(tiny_archs.mixtral_config, tiny_archs.mixtral_weights),
    "gpt_oss": _Arch(tiny_gpt_oss.gpt_oss_config, tiny_gpt_oss.gpt_oss_weights),
    "qwen3_5_moe": _Arch(tiny_qwen3_5.qwen3_5_config, tiny_qwen3_5.qwen3_5_weights),
    "qwen3_next": _Arch(tiny_qwen3_5.qwen3_next_config, tiny_qwen3_5.qwen3_next_weights),
}
"""Architectures ``make_checkpoint`` can build (builders of the others than Qwen3-MoE: ``raymoe.models.tiny_archs``,
``raymoe.models.tiny_gpt_oss``, ``raymoe.models.tiny_qwen3_5``)."""


def _write_weights(tensors: Tensors, folder: Path, max_shard_bytes: int | None) -> None:
    """Write ``model.safetensors``, or ``model-0000i-of-0000K.safetensors`` + index when ``max_shard_bytes``."""
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, str(folder / "model.safetensors"), metadata=meta)
        return
    shards: list[Tensors] = [{}]
    size = 0
    for name, t in tensors.items():  # greedy packing in build order; an oversized tensor gets its own shard
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _make_readable(folder: Path) -> None:
    """``mkdtemp`` (and safetensors) create owner-only entries; a model folder is world-readable like a download."""
    os.chmod(folder, 0o755)
    for f in folder.iterdir():
        os.chmod(f, 0o644)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` folder to ``out`` (replacing an older ``out``) with renames only."""
    if not out.exists():
        os.replace(tmp, out)
        return
    if not out.is_dir():
        raise InvalidRequestError("out", f"{out} exists and is not a folder")
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, trash / out.name)
    os.replace(tmp, out)
    shutil.rmtree(trash, ignore_errors=True)


def _copy_tokenizer(src: Path, dst: Path, vocab_size: int) -> dict:
    """Copy ``src``'s tokenizer files into ``dst``; returns the generation config to write (``src``'s own, else one
    with the tokenizer's eos token).

    Raises:
        InvalidRequestError: no ``tokenizer.json`` in ``src``, or an id of its vocabulary is not below ``vocab_size``
            (names ``tokenizer``).
    """
    from tokenizers import Tokenizer

    if not (src / "tokenizer.json").is_file():
        raise InvalidRequestError("tokenizer", f"{src} has no tokenizer.json")
    size = Tokenizer.from_file(str(src / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise InvalidRequestError("tokenizer", f"{src}'s tokenizer has {size} ids, above vocab_size {vocab_size}")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    if (src / "generation_config.json").is_file():
        return json.loads((src / "generation_config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(dst))
    return {"eos_token_id": [tok.eos_token_id], "do_sample": False}


def make_checkpoint(
    arch: str,
    out: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 4,
    hidden_size: int = 128,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    moe_intermediate_size: int = 64,
    intermediate_size: int = 256,
    vocab_size: int = 2048,
    max_position_embeddings: int = 4096,
    decoder_sparse_step: int = 1,
    mlp_only_layers: tuple[int, ...] = (),
    norm_topk_prob: bool = True,
    tie_word_embeddings: bool = False,
    sliding_window: int = 16,
    mxfp4: bool = False,
    mtp_layers: int = 0,
    max_shard_bytes: int | None = None,
    progress: bool = False,
    quant: str | None = None,
    fp8_scheme: str = "block",
    fp8_block: tuple[int, int] = (128, 128),
    modules_to_not_convert: tuple[str, ...] = (),
    router_skew: float = 0.0,
    tokenizer: str | Path | None = None,
) -> Path:
    """Build a seeded tiny Hugging Face checkpoint folder at ``out`` (atomically) and return its path.

    The folder holds ``config.json``, ``generation_config.json`` (eos ids ``[<|im_end|>, <|endoftext|>]``),
    ``tokenizer.json``/``tokenizer_config.json`` (byte-level BPE of ``vocab_size`` tokens, ChatML template),
    ``raymoe_build.json`` (the build arguments) and
    float32 safetensors under the on-disk HF names (per-expert ``mlp.experts.E.{gate,up,down}_proj.weight``).
    It is built in a temporary folder next to ``out`` and renamed into place, replacing an older ``out``.

    Args:
        arch: architecture key of ``ARCHS``: ``"qwen3_moe"``, ``"deepseek_v3"``, ``"deepseek_v2"``, ``"mixtral"``,
            ``"gpt_oss"``, ``"qwen3_5_moe"`` (the text model, ``model_type`` ``qwen3_5_moe_text``), ``"qwen3_next"``.
        sliding_window: gpt-oss: the window of its sliding layers (tokens); other architectures ignore it.
        mxfp4: gpt-oss: write the experts as MXFP4 blocks and scales; other architectures ignore it.
        mtp_layers: qwen3_5_moe / qwen3_next: 1 writes a multi-token-prediction layer (``mtp.*``, drawn after every
            other tensor, so those stay byte-identical; ``raymoe.models.qwen3_5_mtp``); others ignore it.
        out: destination folder.
        seed: seed of the weight generator; equal arguments give byte-identical tensors.
        max_shard_bytes: split the weights into ``model-0000i-of-0000K.safetensors`` files of at most this many
            bytes (a bigger tensor gets a shard of its own) plus ``model.safetensors.index.json``; ``None``:
            a single ``model.safetensors``.
        progress: show a tqdm bar over the build steps.
        quant: ``"fp8"``: the same seeded weights, every projection stored as ``float8_e4m3fn`` with its scale
            and ``quantization_config`` in ``config.json`` (``raymoe.models.fp8_checkpoint``): ``fp8_scheme``
            ``"block"`` (``weight_scale_inv`` per ``fp8_block`` = ``[bn, bk]`` block, DeepSeek-V3's layout),
            ``"tensor"`` or ``"channel"`` (``weight_scale``); ``modules_to_not_convert`` stay float32 and are listed
            in the config. None: float32 weights.
        router_skew: S >= 0; S > 0 biases every MoE layer's router so a few experts take most tokens (Zipf-like
            by rank, other hot experts per layer, hot ones in the first half of the experts:
            ``raymoe.models.router_skew``); recorded in ``raymoe_build.json``. 0: today's routers, byte-identical.
        tokenizer: a folder whose tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, and its
            ``generation_config.json`` if it has one) are copied instead of training one, e.g. a released model's, so
            that a tiny model speaks its chat format (gpt-oss with harmony's tokens); ``vocab_size`` must hold its
            ids. None: a byte-level BPE trained on the standard library's source.
        Other arguments: model sizes, named as in the Qwen3-MoE config (``num_layers`` = ``num_hidden_layers``,
            ``num_heads``/``num_kv_heads`` = attention/key-value heads).

    Raises:
        InvalidRequestError: unknown ``arch``, inconsistent sizes, ``max_shard_bytes < 1``, an unknown ``quant`` or
            ``fp8_scheme``, ``router_skew`` negative or not finite, a ``tokenizer`` folder without ``tokenizer.json``
            or with ids beyond ``vocab_size``, or ``out`` is a file.
        OSError: the destination cannot be written.
    """
    if arch not in ARCHS:
        raise InvalidRequestError("arch", f"unknown architecture {arch!r}; known: {sorted(ARCHS)}")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise InvalidRequestError("max_shard_bytes", "must be >= 1 or None")
    if quant not in (None, "fp8"):
        raise InvalidRequestError("quant", f"unknown quantization {quant!r}; known: fp8")
    try:
        fp8 = fp8_config(fp8_scheme, fp8_block, tuple(modules_to_not_convert)) if quant == "fp8" else None
    except ValueError as e:
        raise InvalidRequestError("fp8_scheme", str(e)) from e
    router_skew = check_router_skew(router_skew)
    spec = TinyModelSpec(
        num_layers=num_layers, hidden_size=hidden_size, num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, moe_intermediate_size=moe_intermediate_size, intermediate_size=intermediate_size,
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
        decoder_sparse_step=decoder_sparse_step, mlp_only_layers=tuple(int(x) for x in mlp_only_layers),
        norm_topk_prob=norm_topk_prob, tie_word_embeddings=tie_word_embeddings, sliding_window=sliding_window,
        mxfp4=mxfp4, mtp_layers=mtp_layers,
    )
    from tqdm.auto import tqdm

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    builder = ARCHS[arch]
    bar = tqdm(total=spec.num_layers + 4, desc=f"raymoe: building {out.name}", unit="step", disable=not progress)
    try:
        if tokenizer is None:
            build_tokenizer(tmp, vocab_size=spec.vocab_size)
        else:
            generation = _copy_tokenizer(Path(tokenizer), tmp, spec.vocab_size)
        bar.update()
        hf_config = builder.hf_config(spec)
        if fp8 is not None:
            hf_config["quantization_config"] = fp8.to_hf()
        _write_json(tmp / "config.json", hf_config)
        _write_json(tmp / "generation_config.json", generation if tokenizer is not None else {
            "bos_token_id": ENDOFTEXT_ID, "pad_token_id": ENDOFTEXT_ID,
            "eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "do_sample": False,
        })
        build_args = {"arch": arch, "seed": seed, **asdict(spec)}
        if fp8 is not None:
            build_args.update(quant=quant, fp8_scheme=fp8_scheme, fp8_block=list(fp8_block))
        if router_skew:
            build_args["router_skew"] = router_skew
        _write_json(tmp / "raymoe_build.json", build_args)
        gen = torch.Generator().manual_seed(seed)
        tensors: Tensors = {}
        for step in builder.weight_steps(spec, gen):
            tensors.update({k: v.contiguous() for k, v in step.items()})
            bar.update()
        if router_skew:
            tensors = apply_router_skew(tensors, arch, router_skew, seed, spec.num_experts)
        if fp8 is not None:
            tensors = quantize_tensors(tensors, fp8, fp8_scheme)
        _write_weights(tensors, tmp, max_shard_bytes)
        _make_readable(tmp)
        bar.update()
        _replace_dir(tmp, out)
    finally:
        bar.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


TRAINED_DEMOS = {"demo-trained": "qwen3_moe", "demo-trained-deepseek": "deepseek_v3"}
"""Model names that stand for a trained demo checkpoint (``trained_model_path``) and their architectures."""
TRAIN_STEPS = 1500
"""Optimizer steps of a trained demo checkpoint (a fixed count, so every machine builds the same weights; a few
minutes on two cores)."""
TRAIN_RECIPE = {"deepseek_v3": 3}
"""Per architecture (2 where not listed), bumped whenever training would give other weights for the same steps
(part of the trained demos' cache name). 2: the MTP layer's fused expert tensors are drawn from the seed instead of
left as uninitialized memory. 3: DeepSeek's MTP layer is then distilled on the model's greedy text
(``MTP_DISTILL_STEPS``)."""
MTP_DISTILL_STEPS = 1200
"""Steps of the trained DeepSeek demo's MTP distillation (``raymoe.models.draft_distill``; a few minutes on two
cores, pool generation included)."""


def trained_model_path(arch: str = "qwen3_moe", progress: bool = True) -> Path:
    """A demo checkpoint of ``arch`` (``make_checkpoint`` defaults, seed 0) trained ``TRAIN_STEPS`` steps on the
    Python standard library's source (``raymoe.models.train_demo``; DeepSeek-V3 with one MTP layer), built on
    first use in ``cache_dir()`` under a file lock like :func:`default_model_path`. Opt-in: the first build trains
    for minutes.

    Raises:
        InvalidRequestError: an architecture that cannot be trained.
        OSError: the cache folder cannot be written.
    """
    from raymoe.models.train_demo import train_checkpoint

    if arch not in ("qwen3_moe", "deepseek_v3", "deepseek_v2", "mixtral"):
        raise InvalidRequestError("arch", f"no trained demo checkpoint for {arch!r}")
    def build(path: Path) -> None:
        tmp = path.parent / f".{path.name}.building"
        make_checkpoint(arch, tmp, seed=0, progress=progress)
        train_checkpoint(tmp, 0.0, steps=TRAIN_STEPS, seed=0, progress=progress,
                         mtp_distill_steps=MTP_DISTILL_STEPS if arch == "deepseek_v3" else 0)
        _replace_dir(tmp, path)

    recipe = TRAIN_RECIPE.get(arch, 2)
    return _cached_build(f"demo-trained-{arch}-{TRAIN_STEPS}-r{recipe}-v{DEMO_VERSION}", "train_log.json", build)


def _cached_build(name: str, marker: str, build: Callable[[Path], None]) -> Path:
    """``cache_dir() / name``, built once by ``build(path)`` (until ``marker`` exists in it) under a file lock next to
    it, so concurrent processes build it once (the others wait, then reuse it)."""
    from filelock import FileLock

    root = cache_dir()
    path = root / name
    if (path / marker).is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{path.name}.lock")):
        if not (path / marker).is_file():
            build(path)
    return path


def default_model_path(progress: bool = True) -> Path:
    """The demo checkpoint (``qwen3_moe``, ``make_checkpoint`` defaults, seed 0), built on first use.

    Lives in ``cache_dir() / "demo-qwen3_moe-v{DEMO_VERSION}"``; a file lock next to it makes concurrent
    processes build it once (the others wait, then reuse it).

    Raises:
        OSError: the cache folder cannot be written (or the lock cannot be taken).
    """
    return _cached_build(f"demo-qwen3_moe-v{DEMO_VERSION}", "config.json",
                         lambda path: make_checkpoint("qwen3_moe", path, seed=0, progress=progress))
