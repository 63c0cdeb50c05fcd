"""The checkpoint's ``quantization_config``, parsed once into a frozen record of ``ModelConfig`` (``quantization``).

Supported: ``quant_method: "fp8"`` (the Hugging Face / vLLM / SGLang name) in three layouts, each an FP8 E4M3 weight
(``float8_e4m3fn``) stored with a float32 scale that multiplies it back (``w = fp8 * scale``):

* block-wise (``weight_block_size: [bn, bk]``; DeepSeek-V3/R1, Qwen3 FP8): ``{module}.weight_scale_inv``
  ``[ceil(N / bn), ceil(K / bk)]``, block ``[i // bn, j // bk]`` scaling weight ``[i, j]``, partial edge blocks
  included (DeepSeek's ``weight_dequant``; despite its name the tensor is the multiplier);
* per-tensor (no ``weight_block_size``): ``{module}.weight_scale`` of shape ``[]`` or ``[1]``;
* per-channel (no ``weight_block_size``): ``{module}.weight_scale`` of shape ``[N]`` or ``[N, 1]``.

Which of the last two a module has is read from its scale's shape at load. Only ``activation_scheme: "dynamic"`` is
taken (activations are quantized per call on GPUs, never from stored ``input_scale`` tensors). Any other
``quant_method`` (``awq``, ``gptq``, ``bitsandbytes`` ...) and any field this module does not know are refused with a
``ValueError`` naming them (``ModelConfig.from_hf`` turns it into a ``CheckpointError``). This module imports nothing
from raymoe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FP8_FIELDS = frozenset({"quant_method", "fmt", "weight_block_size", "activation_scheme", "modules_to_not_convert"})
"""The ``quantization_config`` keys of ``quant_method: "fp8"`` that raymoe understands."""

FP8_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` value."""


@dataclass(frozen=True)
class Fp8Config:
    """FP8 weight quantization of a checkpoint (module docstring).

    Attributes:
        weight_block_size: ``(bn, bk)``: one scale per ``bn`` output rows x ``bk`` input columns; None: per-tensor
            or per-channel scales (``weight_scale``).
        activation_scheme: ``"dynamic"`` (the only one taken).
        modules_to_not_convert: module names kept unquantized (``lm_head``, ``model.layers.0.mlp.gate`` ...); a
            module matches an entry equal to its name or to a dotted prefix or suffix of it
            (:meth:`quantizes`).
    """

    weight_block_size: tuple[int, int] | None = (128, 128)
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        b = self.weight_block_size
        if b is not None and (len(b) != 2 or any(not isinstance(x, int) or x < 1 for x in b)):
            raise ValueError(f"quantization_config.weight_block_size must be two positive ints, got {b!r}")
        if self.activation_scheme != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme {self.activation_scheme!r} is not supported "
                             "(only 'dynamic'; static input scales are not applied)")

    @property
    def scale_name(self) -> str:
        """The scale tensor's suffix beside ``{module}.weight``: ``weight_scale_inv`` (block-wise) or
        ``weight_scale``."""
        return "weight_scale_inv" if self.weight_block_size is not None else "weight_scale"

    def quantizes(self, module: str) -> bool:
        """Whether module ``module`` (a full dotted name: ``model.layers.3.self_attn.o_proj``) is stored in FP8:
        False when an entry of ``modules_to_not_convert`` equals it or a dotted prefix or suffix of it."""
        for entry in self.modules_to_not_convert:
            if module == entry or module.startswith(entry + ".") or module.endswith("." + entry):
                return False
        return True

    def to_hf(self) -> dict[str, Any]:
        """The ``quantization_config`` this record reads back from (``make-checkpoint --quant fp8``)."""
        d: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": self.activation_scheme}
        if self.weight_block_size is not None:
            d["weight_block_size"] = list(self.weight_block_size)
        if self.modules_to_not_convert:
            d["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return d


def parse_quantization_config(d: dict[str, Any] | None) -> Fp8Config | None:
    """``config.json``'s ``quantization_config`` (or None) -> :class:`Fp8Config` (or None: not quantized).

    Raises:
        ValueError: a ``quant_method`` other than ``fp8`` (named), a field outside :data:`FP8_FIELDS` (named), an
            ``fmt`` other than ``e4m3``, or a bad value (named; see :class:`Fp8Config`).
    """
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ValueError(f"quantization_config must be an object, got {type(d).__name__}")
    method = d.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (only 'fp8')")
    unknown = sorted(set(d) - FP8_FIELDS)
    if unknown:
        raise ValueError(f"quantization_config (quant_method 'fp8') has fields raymoe does not understand: "
                         f"{unknown}")
    fmt = d.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r} is not supported (only 'e4m3', float8_e4m3fn)")
    block = d.get("weight_block_size")
    skip = d.get("modules_to_not_convert") or ()
    if isinstance(skip, str) or not all(isinstance(m, str) for m in skip):
        raise ValueError(f"quantization_config.modules_to_not_convert must be a list of names, got {skip!r}")
    return Fp8Config(weight_block_size=None if block is None else tuple(block),
                     activation_scheme=str(d.get("activation_scheme", "dynamic")),
                     modules_to_not_convert=tuple(skip))
