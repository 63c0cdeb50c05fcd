"""Where the paged MLA kernel comes from: FlashInfer's ``flashinfer.mla.BatchMLAPagedAttentionWrapper``, looked up
lazily.

raymoe never needs the package (``flashinfer-python``) to install, import or test. It is imported only when the
``flashinfer_mla`` attention backend is selected: by :func:`check_flashinfer_mla_config`, which ``EngineConfig``
and ``RunnerConfig`` call (a missing package or a dtype the kernel does not take fails at config time), and by the
backend when it is built. Both go through the module attribute :func:`find_flashinfer_mla`, which tests replace
(``monkeypatch``) to inject a CPU conformance double of the wrapper (``tests/flashinfer_mla_double.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.errors import BackendUnavailableError, InvalidRequestError

PACKAGE = "flashinfer-python"
"""Distribution that provides the ``flashinfer`` module (``pip install flashinfer-python``; it JIT-compiles or
loads prebuilt kernels on first use)."""

HEAD_DIMS = ((512, 64),)
"""``(kv_lora_rank, qk_rope_head_dim)`` the wrapper's kernels are built ahead of time and tested for
(``flashinfer/aot.py``, ``tests/attention/test_deepseek_mla.py``): every DeepSeek-V2/V3 checkpoint's."""

WORKSPACE_BYTES = 128 * 1024 * 1024
"""The float workspace FlashInfer recommends for the MLA wrapper's split-k partial results (bytes)."""


@dataclass(frozen=True)
class FlashInferMLAProvider:
    """One implementation of ``BatchMLAPagedAttentionWrapper``.

    Attributes:
        name: where it comes from (``"flashinfer.mla"``, or a test double's name).
        wrapper_cls: the class, with FlashInfer's constructor ``(float_workspace_buffer, use_cuda_graph=False,
            qo_indptr=None, kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto")``, ``plan(...)`` and
            ``run(q_nope, q_pe, ckv_cache, kpe_cache, out=None, ...)``.
        dtypes: activation and cache dtypes it takes, as ``EngineConfig.dtype`` names (its kernels: fp16, bf16).
        head_dims: ``(kv_lora_rank, qk_rope_head_dim)`` pairs it takes.
        workspace_bytes: size of the float workspace to hand it (bytes).
        devices: where it computes (the kernels: ``("cuda",)``; a CPU conformance double adds ``"cpu"``).
    Raises:
        ValueError: an empty ``dtypes`` or ``head_dims``, or ``workspace_bytes`` below 1.
    """

    name: str
    wrapper_cls: type
    dtypes: tuple[str, ...] = ("float16", "bfloat16")
    head_dims: tuple[tuple[int, int], ...] = HEAD_DIMS
    workspace_bytes: int = WORKSPACE_BYTES
    devices: tuple[str, ...] = ("cuda",)

    def __post_init__(self):
        if not self.dtypes or not self.head_dims or self.workspace_bytes < 1:
            raise ValueError("a FlashInfer MLA provider needs dtypes, head_dims and a workspace of >= 1 byte")


def find_flashinfer_mla() -> FlashInferMLAProvider:
    """Import ``flashinfer.mla`` and describe its wrapper.

    Raises:
        BackendUnavailableError: the package is not importable (the message names ``flashinfer-python``).
    """
    try:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
    except ImportError as e:
        raise BackendUnavailableError(
            "attention_backend", f"'flashinfer_mla' needs FlashInfer (module flashinfer.mla, from the '{PACKAGE}' "
            f"package: pip install {PACKAGE}); it could not be imported: {e}. Use attention_backend='torch_native' "
            "instead") from e
    return FlashInferMLAProvider("flashinfer.mla", BatchMLAPagedAttentionWrapper)


def check_flashinfer_mla_config(dtype: str) -> FlashInferMLAProvider:
    """Config-time checks of the ``flashinfer_mla`` backend: the wrapper is importable and takes ``dtype`` (the
    model's head dims are checked when the backend is built, where the model config is known).

    Returns:
        the provider (found through the module attribute ``find_flashinfer_mla``).
    Raises:
        BackendUnavailableError: the package is missing. InvalidRequestError: ``dtype`` (field ``"dtype"``).
    """
    provider = find_flashinfer_mla()  # looked up in this module's globals at call time: tests can replace it
    if dtype not in provider.dtypes:
        raise InvalidRequestError("dtype", f"the flashinfer_mla backend ({provider.name}) takes {provider.dtypes}, "
                                           f"got {dtype!r}")
    return provider
