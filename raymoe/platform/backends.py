"""Optional GPU backends: what each needs, the config-time check, and the ``raymoe env`` report.

GPU backends are never needed to install, import or test raymoe. Each is imported lazily where it is built; this
module only looks for the packages (``importlib.util.find_spec``: nothing is imported, so the check is cheap
and works on a machine without CUDA) so that choosing a backend whose package is missing fails when the engine
is configured, with the package named, instead of in the middle of a rank's start-up.
"""

from __future__ import annotations

import importlib.util
import platform
from dataclasses import dataclass

from raymoe.errors import InvalidRequestError


@dataclass(frozen=True)
class GpuBackend:
    """One optional backend: the engine option that selects it, the module(s) that provide it (any one is
    enough), how to install it, and whether :func:`check_gpu_backends` looks for the package (False where the
    backend's own config check imports it: ``flash_attn``, ``raymoe.platform.cuda.flash_attn_provider``)."""

    option: str
    value: str
    modules: tuple[str, ...]
    install: str
    check_package: bool = True


GPU_BACKENDS: tuple[GpuBackend, ...] = (
    GpuBackend("a2a_backend", "deepep", ("deep_ep",),
               "pip install 'raymoe[deepep]' (SGLang's sgl-deep-ep wheel, a CUDA 13 build that pins one torch "
               "version), or build DeepEP from source against your torch (README, 'GPU backends')"),
    GpuBackend("attention_backend", "flash_attn", ("vllm",),
               "pip install vllm (its vllm.vllm_flash_attn provides flash_attn_varlen_func)", check_package=False),
    GpuBackend("attention_backend", "flashinfer_mla", ("flashinfer",),
               "pip install flashinfer-python (its flashinfer.mla provides BatchMLAPagedAttentionWrapper)",
               check_package=False),
)


def backend_devices(backend: GpuBackend) -> tuple[str, ...]:
    """Where ``backend`` computes: ``("cuda",)``, or what its provider declares for the attention backends whose
    provider the config check finds (a CPU conformance double declares ``"cpu"`` too, so tests run the engine
    through it on CPU; a missing package answers ``("cuda",)``)."""
    from raymoe.errors import BackendUnavailableError

    try:
        if backend.value == "flash_attn":
            from raymoe.platform.cuda import flash_attn_provider

            return flash_attn_provider.find_flash_attn().devices
        if backend.value == "flashinfer_mla":
            from raymoe.platform.cuda import flashinfer_mla_provider

            return flashinfer_mla_provider.find_flashinfer_mla().devices
    except BackendUnavailableError:
        pass
    return ("cuda",)


def module_available(name: str) -> bool:
    """Whether top-level module ``name`` can be imported (found on the path; not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


#: Expert-parallel sizes DeepEP v1.2.1 runs: its intranode kernels take 2, 4 or 8 ranks (``SWITCH_RANKS``), its
#: internode ones 2, 4, 8, 16, 18 or 20 nodes of 8 ranks (``SWITCH_RDMA_RANKS``), and ``Buffer.get_dispatch_config``
#: has a config for each of them (24 has a config but 3 nodes no internode kernel).
DEEPEP_EP_SIZES = (2, 4, 8, 16, 32, 64, 128, 144, 160)


def check_gpu_backends(config) -> None:
    """Refuse GPU backends that cannot run: on ``device="cpu"``, without their package, or (DeepEP) in a dtype
    or at an expert-parallel size its kernels do not take.

    Args:
        config: an ``EngineConfig`` (reads ``device``, ``kernel_dtype``, ``attention_backend``,
            ``moe_comm.a2a_backend``, ``parallel.ep_size``).
    Raises:
        InvalidRequestError: naming the option, and the package to install when it is missing.
    """
    chosen = {"attention_backend": config.attention_backend, "a2a_backend": config.moe_comm.a2a_backend}
    for backend in GPU_BACKENDS:
        if chosen[backend.option] != backend.value:
            continue
        if config.device == "cpu" and "cpu" not in backend_devices(backend):
            raise InvalidRequestError(backend.option, f"{backend.value!r} runs on CUDA only; use device='cuda' "
                                                      f"or the CPU backend")
        if backend.check_package and not any(module_available(m) for m in backend.modules):
            raise InvalidRequestError(backend.option, f"{backend.value!r} needs the package providing "
                                                      f"{' or '.join(backend.modules)}, which is not installed: "
                                                      f"{backend.install}")
    if chosen["a2a_backend"] == "deepep" and config.kernel_dtype != "bfloat16":
        raise InvalidRequestError("dtype", f"a2a_backend='deepep' moves bfloat16 rows only (its combine and "
                                           f"low-latency kernels), got dtype={config.dtype!r}")
    ep = config.parallel.ep_size
    if chosen["a2a_backend"] == "deepep" and ep > 1 and ep not in DEEPEP_EP_SIZES:
        raise InvalidRequestError("ep_size", f"a2a_backend='deepep' runs ep_size {DEEPEP_EP_SIZES} (its kernels: 2, "
                                             f"4 or 8 ranks of one node, or nodes of 8 ranks), got {ep}")


def environment_report() -> dict[str, str]:
    """Versions and capabilities relevant to raymoe on this machine (``raymoe env``), as printable strings:
    python, torch, CUDA (compiled / driver-visible devices), NCCL, gloo, whether each GPU backend's package
    imports (an import is attempted here, so a broken install shows up), and the installed versions of the
    distributions that pin torch or provide a backend (``pip <name>``)."""
    import torch
    import torch.distributed as dist

    report = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
              "torch.version.cuda": str(torch.version.cuda), "cuda.is_available": str(torch.cuda.is_available()),
              "cuda.device_count": str(torch.cuda.device_count() if torch.cuda.is_available() else 0),
              "gloo": str(dist.is_available() and dist.is_gloo_available()),
              "nccl": str(dist.is_available() and dist.is_nccl_available())}
    if torch.cuda.is_available():
        report["cuda.device0"] = torch.cuda.get_device_name(0)
        try:
            report["nccl.version"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001 - report, never fail
            report["nccl.version"] = f"unavailable ({type(e).__name__})"
    for backend in GPU_BACKENDS:
        report[f"{backend.option}={backend.value}"] = _import_status(backend.modules)
    if module_available("vllm"):  # the flash-attention backend calls vllm's own build of the kernels
        report["vllm.vllm_flash_attn"] = _import_status(("vllm.vllm_flash_attn",))
    for name in ("ray", "transformers"):
        report[name] = _import_status((name,))
    from raymoe.kvcache.kv_transfer import active_kv_backend, nixl_available

    nixl = _import_status(("nixl._api", "nixl_cu12._api", "nixl_cu13._api")) if nixl_available() else "not installed"
    report["kv_transfer"] = f"{active_kv_backend()} (prefill -> decode KV transfer; nixl: {nixl})"
    for name in REPORTED_DISTRIBUTIONS:
        report[f"pip {name}"] = _distribution_version(name)
    return report


REPORTED_DISTRIBUTIONS = ("torch", "vllm", "sgl-deep-ep", "deep-ep", "ray", "transformers", "nixl-cu12")
"""Installed distributions ``raymoe env`` lists by version: the GPU extras' packages (``pip install
'raymoe[gpu]'``: vLLM; ``'raymoe[deepep]'``: sgl-deep-ep; a source build of DeepEP installs ``deep_ep``, found
as ``deep-ep``), what pins torch, and NIXL (the KV transfer of prefill/decode disaggregation)."""


def _distribution_version(name: str) -> str:
    """The installed version of distribution ``name`` (package metadata only: nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _import_status(modules: tuple[str, ...]) -> str:
    for name in modules:
        if not module_available(name):
            continue
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a broken install is reported, not raised
            return f"broken ({type(e).__name__}: {e})"
        return f"ok ({name} {getattr(module, '__version__', '?')})"
    return f"missing ({' or '.join(modules)})"


def check_attention_backend(name: str, page_size: int, dtype: str) -> None:
    """Config-time check of attention backend ``name`` for ``page_size`` tokens per KV page and ``dtype`` (the
    flash-attention adapter checks its package, page size and dtype, FlashInfer's MLA its package and dtype;
    ``torch_native`` takes any).

    Raises:
        InvalidRequestError: naming ``attention_backend``, ``page_size`` or ``dtype``.
    """
    if name == "flash_attn":
        from raymoe.platform.cuda.flash_attn_provider import check_flash_attn_config

        check_flash_attn_config(page_size, dtype)
    elif name == "flashinfer_mla":
        from raymoe.platform.cuda.flashinfer_mla_provider import check_flashinfer_mla_config

        check_flashinfer_mla_config(dtype)
