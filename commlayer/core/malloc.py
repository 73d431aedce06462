"""Allocator tuning at init: glibc keeps a training step's freed memory for the next step.

1. What it answers: a CPU training step frees and allocates again the same tensors every step
   (gradients with ``zero_grad(set_to_none=True)``, activations). glibc serves blocks of at
   least its mmap threshold (128 KiB at start) with fresh ``mmap`` pages, and gives free memory
   at the top of the heap back to the OS once it exceeds its trim threshold; both come back the
   next step as page faults, each one a zeroed 4 KiB page. Measured on the benchmark MLP
   (benchmarks/train.py, 6.7 M parameters, one process): 5,152 page faults per backward pass,
   backward 21-23 ms; with the thresholds below 0 faults, 14-15 ms. The ResNet at 2 ranks:
   11,440 faults per backward, step 344 -> 276 ms.
2. glibc raises both thresholds by itself after it frees a large mmapped block (the mmap one up
   to 32 MiB on 64-bit, the trim one to twice that), so whether a process pays the faults
   depends on its allocation history: the DDP and Horovod processes of the same benchmark
   happened to reach 0 faults per MLP backward, a commlayer one did not.
3. So ``init()`` sets what glibc's own rule ends at: mmap threshold 32 MiB, trim threshold
   64 MiB (``mallopt``, process-wide; setting them also stops glibc adjusting them further).
   Peak memory is unchanged (a training loop reaches the same peak every step); up to 64 MiB
   of freed memory at the top of the heap stays with the process instead of going back to the
   OS between steps.
4. Left alone: ``COMMLAYER_MALLOC_TUNING=off``; a process whose user set glibc's own
   ``MALLOC_*_`` variables (their choice wins); a C library other than glibc (no ``mallopt``);
   a malloc replaced by ``LD_PRELOAD`` (jemalloc, tcmalloc) is not glibc's and is unaffected.
"""

from __future__ import annotations

import ctypes
import threading

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, its own ceiling
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES  # as glibc's dynamic rule sets it

_lock = threading.Lock()
_status: str | None = None


def tune(setting: bool, user_variables: list[str]) -> str:
    """Apply the tuning once per process; returns what was done (for the log and tests).

    ``setting``: COMMLAYER_MALLOC_TUNING (on: True); ``user_variables``: glibc MALLOC_*_
    variables set in the environment (config.glibc_malloc_variables())."""
    global _status
    with _lock:
        if _status is not None:  # set only once tuned
            return _status
        if not setting:
            return "off (COMMLAYER_MALLOC_TUNING=off)"
        if user_variables:
            return f"left to the user's {', '.join(user_variables)}"
        libc = _glibc()
        if libc is None:
            return "not glibc: nothing to tune"
        if not (
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
            and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        ):
            return "glibc refused mallopt"
        _status = (
            f"tuned: glibc mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB, "
            f"trim threshold {TRIM_THRESHOLD_BYTES >> 20} MiB"
        )
        return _status


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return libc
