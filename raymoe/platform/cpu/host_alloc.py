"""Keep freed host memory for reuse, so a CPU rank's steps do not page-fault their activations in afresh.

PyTorch's CPU allocator is glibc ``malloc``. With glibc's defaults, a block above the (dynamic) mmap threshold
is a fresh ``mmap`` each time, and the free space at the top of the heap is handed back to the kernel once it
exceeds the trim threshold (twice the mmap threshold). A decode step allocates and frees the same few megabyte
tensors every layer (MoE dispatch buffers, expert activations), so each step touched fresh pages again: about
5,600 minor faults per step for a bs 64 low-latency decode on two ranks (22 MiB), at about 3.3 us each on the
CI machine's VM (minor faults per step counted in ``raymoe bench overlap --batch-sizes 64``; none per step after
warm-up with these settings). Half-batches (two-batch overlap) stayed under the
thresholds and did not fault, so the faults also skewed the serial vs TBO comparison.

:func:`tune_host_allocator` raises the mmap threshold to glibc's maximum (32 MiB; larger tensors, the weights,
are still mapped on their own) and stops heap trimming, so freed blocks are reused by the next step. The price
is that a rank's heap keeps its high-water mark, as a GPU caching allocator does. Set
``RAYMOE_HOST_MALLOC_TUNING=0`` to keep glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1   # mallopt parameters, glibc <malloc.h>
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20   # glibc's largest accepted value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: trim only above 2 GiB of free heap top
_done: bool | None = None


def tune_host_allocator() -> bool:
    """Apply the settings above to this process once (later calls return the first answer).

    Returns:
        whether glibc accepted both settings (False: not glibc, disabled by ``RAYMOE_HOST_MALLOC_TUNING=0``,
        or ``mallopt`` refused; the defaults then stay, which is only slower).
    """
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("RAYMOE_HOST_MALLOC_TUNING", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not _done:
        logger.warning("mallopt refused the host allocator settings; steps may page-fault their buffers afresh")
    return _done
