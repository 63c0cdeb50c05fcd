"""Build and load raymoe's fused CPU kernels (``csrc/*.c``, one concern per file, sharing ``csrc/cpu_ops.h``) as one
shared library bound through ``ctypes``.

The sources are plain C (no torch headers), so a build takes about a second with the system C compiler
(``$CC``, else ``cc``). The library is cached under ``cache_dir() / "kernels"``, keyed by a hash of the sources,
the compiler's version line, the flags and this machine's CPU flags (``-march=native`` code must not run on
another CPU model sharing the cache folder). A build writes a temporary file and renames it into place, so
processes that build at once never load a half-written library.

Nothing here is needed to run raymoe: without a compiler, with a failed build, or with ``RAYMOE_CPU_KERNELS=0``
in the environment, :func:`load` returns ``None`` and every caller keeps its torch path (a warning says why,
once per process).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(CSRC.glob("*.c")))  # each file's first comment says what it holds
HEADERS = tuple(sorted(CSRC.glob("*.h")))
# -fno-math-errno / -fno-trapping-math: let GCC vectorize floorf and the clamps of fast_expf (no FP traps used)
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")
ENV_SWITCH = "RAYMOE_CPU_KERNELS"  # "0": never load the kernels (torch paths everywhere)

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# exported symbol -> (restype, argtypes); the C sources document each one
SIGNATURES: dict[str, tuple[object, list]] = {
    "raymoe_add_rms_norm_f32": (None, [_P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _F32]),
    "raymoe_qk_norm_rope_f32": (_INT, [_P, _I64, _I64, _I64, _I64, _P, _F32, _P, _P, _P, _I64]),
    "raymoe_kv_store_f32": (_INT, [_P, _I64, _P, _I64, _P, _I64, _I64, _P, _P, _I64]),
    "raymoe_paged_attention_f32": (_INT, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64,
                                          _I64, _F32, _P, _I64]),
    "raymoe_sample_rows_f32": (None, [_P, _I64, _I64, _I64, _P, _P, _P, _P]),
    "raymoe_apply_penalties_f32": (_INT, [_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _P, _I64, _P, _P, _P]),
    "raymoe_topk_softmax_f32": (None, [_P, _I64, _I64, _I64, _I64, _INT, _F32, _P, _P]),
    "raymoe_attn_block_f32": (_INT, [_P, _P, _I64, _I64, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _P,
                                     _P, _P]),
    "raymoe_pack_f32": (None, [_P, _I64, _I64, _I64, _P]),
    "raymoe_linear_packed_f32": (None, [_P, _I64, _I64, _P, _I64, _I64, _P, _I64]),
    "raymoe_grouped_linear_packed_f32": (_INT, [_P, _I64, _I64, _P, _I64, _P, _I64, _I64, _I64, _P, _I64]),
    "raymoe_moe_routed_rows_f32": (_INT, [_P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64,
                                          _I64, _P, _P, _I64, _I64, _P]),
    "raymoe_fp8_dequant_f32": (None, [_P, _I64, _I64, _I64, _P, _I64, _I64, _P]),
    "raymoe_flag_store_wake": (None, [_P, _I64]),
    "raymoe_flag_wait_ge": (_INT, [_P, _I64, ctypes.c_double, _I64]),
    "raymoe_shm_post_equal": (_INT, [_P, _I64, _I64, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, ctypes.c_double,
                                     _I64]),
    "raymoe_shm_receive_equal": (_INT, [_P, _I64, _I64, _I64, _I64, _I64, _I64, _P, _I64, ctypes.c_double, _I64]),
}

_loaded: ctypes.CDLL | None = None
_tried = False
_override: bool | None = None  # set by reset(enabled=...): wins over RAYMOE_CPU_KERNELS until reset() clears it


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc")


def _cpu_flags() -> str:
    """This machine's CPU model and feature flags (Linux), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor()


def library_path(cc: str) -> Path:
    """Where the library built by compiler ``cc`` for this source and machine lives (it may not exist yet)."""
    from raymoe.paths import cache_dir

    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    key = hashlib.sha256()
    sources = [f.name.encode() + f.read_bytes() for f in (*SOURCES, *HEADERS)]
    for part in (*sources, repr(version).encode(), repr(CFLAGS).encode(), _cpu_flags().encode(),
                 platform.machine().encode()):
        key.update(part)
    return cache_dir() / "kernels" / f"cpu_ops-{key.hexdigest()[:16]}.so"


def build(cc: str) -> Path:
    """Compile the library with ``cc`` unless it is cached; return its path.

    Raises:
        RuntimeError: the compiler failed (its output is in the message).
        OSError: the cache folder cannot be written.
    """
    path = library_path(cc)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            names = ", ".join(f.name for f in SOURCES)
            raise RuntimeError(f"{cc} failed on the kernel sources ({names}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; ``None`` when it is switched off or cannot be built (the
    reason is logged once). The result is cached for the process."""
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    enabled = os.environ.get(ENV_SWITCH, "1") != "0" if _override is None else _override
    if not enabled:
        logger.info("fused CPU kernels switched off (%s=0 or reset(enabled=False)): torch operators only",
                    ENV_SWITCH)
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler ($CC, cc or gcc) found: fused CPU kernels off, torch operators only")
        return None
    try:
        _loaded = _bind(ctypes.CDLL(str(build(cc))))
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        logger.warning("fused CPU kernels unavailable, torch operators only: %s", e)
        _loaded = None
    return _loaded


def reset(enabled: bool | None = None) -> None:
    """Forget the loaded library so the next :func:`load` decides again: switched on (when buildable) or off
    by ``enabled``, or by ``RAYMOE_CPU_KERNELS`` again when ``enabled`` is None. The environment is never
    written. For tests and benchmarks that compare both paths in one process."""
    global _loaded, _tried, _override
    _loaded, _tried, _override = None, False, enabled
