"""Whether the MPI library takes CUDA device buffers (CUDA-aware MPI), for the MPI backend.

``COMMLAYER_CUDA_AWARE_MPI`` decides: ``1`` and ``0`` are the user's word; ``auto`` asks the
library, in this order, and stages through pinned host buffers when nothing can tell:

1. mpi4py's own query (``MPI.Query_cuda_support``, where the mpi4py version has it);
2. ``MPIX_Query_cuda_support()`` in the loaded MPI library (Open MPI >= 2, MVAPICH2 >= 2.3.4,
   MPICH >= 4), found with ctypes through mpi4py's extension module;
3. MPICH's ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``.

MPICH turns its GPU support off at run time with ``MPIR_CVAR_ENABLE_GPU=0`` (then a query may
still say yes): that wins. ``decide`` holds the logic and takes the queries as arguments, so
the unit tests run it without MPI (tests/unit/test_cuda_aware.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from typing import Any

MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's enum value (mpi.h: MPIX_GPU_SUPPORT_CUDA, _ZE, _HIP)

Query = Callable[[], "bool | None"]  # True/False, or None: this query cannot tell


def decide(
    setting: bool | None, environ: Mapping[str, str], queries: list[Query]
) -> tuple[bool, str]:
    """(CUDA-aware, why) from the setting (on, off, or None: auto), the environment and the
    library's queries (tried in order; the first that tells decides)."""
    if setting is not None:
        return setting, f"COMMLAYER_CUDA_AWARE_MPI={'on' if setting else 'off'}"
    gpu = environ.get("MPIR_CVAR_ENABLE_GPU", "").strip().lower()
    if gpu in ("0", "false", "no", "off"):
        return False, f"MPIR_CVAR_ENABLE_GPU={environ['MPIR_CVAR_ENABLE_GPU']} (MPICH's GPU off)"
    for query in queries:
        try:
            answer = query()
        except Exception:  # noqa: BLE001 - a query that fails cannot tell
            answer = None
        if answer is not None:
            name = getattr(query, "__name__", "query")
            return bool(answer), f"{name}() says {'yes' if answer else 'no'}"
    return False, "the MPI library cannot tell (COMMLAYER_CUDA_AWARE_MPI=on to force)"


def library_queries(mpi: Any) -> list[Query]:
    """The queries ``decide`` tries, for mpi4py's ``MPI`` module (MPI initialized)."""

    def mpi4py_query() -> bool | None:
        query = getattr(mpi, "Query_cuda_support", None)
        return None if query is None else bool(query())

    def _lib() -> Any:
        return ctypes.CDLL(mpi.__file__)  # dlsym also searches its libmpi dependency

    def MPIX_Query_cuda_support() -> bool | None:  # noqa: N802 - the C function's name
        func = getattr(_lib(), "MPIX_Query_cuda_support", None)
        if func is None:
            return None
        func.restype, func.argtypes = ctypes.c_int, []
        value = func()
        return None if value < 0 else value == 1

    def MPIX_GPU_query_support() -> bool | None:  # noqa: N802
        func = getattr(_lib(), "MPIX_GPU_query_support", None)
        if func is None:
            return None
        func.restype = ctypes.c_int
        func.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        flag = ctypes.c_int(0)
        if func(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) != 0:
            return None
        return flag.value == 1

    mpi4py_query.__name__ = "MPI.Query_cuda_support"
    return [mpi4py_query, MPIX_Query_cuda_support, MPIX_GPU_query_support]
