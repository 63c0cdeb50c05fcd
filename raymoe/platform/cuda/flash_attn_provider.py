"""Where the flash-attention kernel comes from: vLLM's fork, ``vllm.vllm_flash_attn``, looked up lazily.

raymoe never needs the package to install, import or test. It is imported only when the ``flash_attn`` backend is
selected: by :func:`check_flash_attn_config`, which ``EngineConfig`` and ``RunnerConfig`` call (so a missing
package, or options the kernel cannot run, fail at config time rather than mid-step), and by the backend when it
is built. Both go through the module attribute :func:`find_flash_attn`, which tests replace (``monkeypatch``) to
inject a CPU conformance double of the kernel (``tests/doubles/flash_attn_double.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from raymoe.errors import BackendUnavailableError, InvalidRequestError

PACKAGE = "vllm"
"""Distribution that provides ``vllm.vllm_flash_attn`` (``pip install vllm``; its CUDA build ships the kernels)."""

MIN_PAGE_MULTIPLE = 16
"""The kernel's paged-KV check: the block (page) size must be a multiple of 16 tokens."""


@dataclass(frozen=True)
class FlashAttnProvider:
    """One implementation of ``flash_attn_varlen_func``.

    Attributes:
        name: where it comes from (``"vllm.vllm_flash_attn"``, or a test double's name).
        varlen_func: the function, with vLLM's signature (q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, ...,
            seqused_k, softmax_scale, causal, block_table, out, fa_version).
        dtypes: activation dtypes it accepts, as ``EngineConfig.dtype`` names (the kernels: fp16 and bf16).
        fa_version: the ``fa_version`` argument to pass (2, or 3 where the FA3 kernels run).
        devices: where it computes (the kernels: ``("cuda",)``; a CPU conformance double adds ``"cpu"``, which
            lets the engine choose the backend with ``device="cpu"``: ``raymoe.platform.backends``).
    """

    name: str
    varlen_func: Callable
    dtypes: tuple[str, ...]
    fa_version: int
    devices: tuple[str, ...] = ("cuda",)


def find_flash_attn() -> FlashAttnProvider:
    """Import ``vllm.vllm_flash_attn`` and describe it; picks FA3 where the fork says it is supported, else FA2.

    Raises:
        BackendUnavailableError: the package is not importable (the message names ``vllm``).
    """
    try:
        import vllm.vllm_flash_attn as fa
    except ImportError as e:
        raise BackendUnavailableError(
            "attention_backend", f"'flash_attn' needs vLLM's flash-attention (module vllm.vllm_flash_attn, from the "
            f"'{PACKAGE}' package: pip install {PACKAGE}); it could not be imported: {e}. "
            "Use attention_backend='torch_native' instead") from e
    version = 2
    supported = getattr(fa, "is_fa_version_supported", None)
    if supported is not None:
        try:
            version = 3 if supported(3) else 2
        except (RuntimeError, AssertionError):  # no CUDA device to ask
            version = 2
    return FlashAttnProvider("vllm.vllm_flash_attn", fa.flash_attn_varlen_func, ("float16", "bfloat16"), version)


def check_flash_attn_config(page_size: int, dtype: str) -> FlashAttnProvider:
    """Config-time checks of the ``flash_attn`` backend: the kernel is importable, takes ``dtype``, and pages of
    ``page_size`` tokens.

    Returns:
        the provider (found through the module attribute ``find_flash_attn``).

    Raises:
        BackendUnavailableError: the package is missing. InvalidRequestError: ``dtype`` (``"dtype"``) or
            ``page_size`` (``"page_size"``) is not supported.
    """
    provider = find_flash_attn()  # looked up in this module's globals at call time: tests can replace it
    if dtype not in provider.dtypes:
        raise InvalidRequestError("dtype", f"the flash_attn backend ({provider.name}) takes {provider.dtypes}, "
                                           f"got {dtype!r}")
    if page_size % MIN_PAGE_MULTIPLE:
        raise InvalidRequestError("page_size", f"the flash_attn backend needs a multiple of {MIN_PAGE_MULTIPLE} "
                                               f"tokens, got {page_size}")
    return provider
