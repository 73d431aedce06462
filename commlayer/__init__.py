"""commlayer: communication middleware for distributed training in PyTorch.

``import commlayer as hvd`` works for horovod.torch users: same names, arguments and semantics.
"""

import sys as _sys
import types as _types
from importlib.util import find_spec as _find_spec

import torch as _torch

from commlayer import compression, elastic
from commlayer.common import config
from commlayer.common.errors import (
    CollectiveTimeoutError,
    CommlayerError,
    ConfigError,
    DuplicateNameError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    NotInitializedError,
    RankDiedError,
    ShutdownError,
    StallError,
    TensorMismatchError,
    UnsupportedOpError,
)
from commlayer.common.reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from commlayer.compression import Compression
from commlayer.core import runtime as _runtime
from commlayer.core.future import Future, Handle
from commlayer.core.process_sets import ProcessSet, global_process_set
from commlayer.core.runtime import (
    backend_name,
    communication_stats,
    cross_rank,
    cross_size,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
    startup_summary,
)
from commlayer.functions import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from commlayer.ops import (
    add_process_set,
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    batch,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    remove_process_set,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from commlayer.optimizer import DistributedOptimizer
from commlayer.state_sync import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from commlayer.sync_batch_norm import SyncBatchNorm

__version__ = "0.1.0"

# Paths that README and scripts written before the core/ folder existed import
# (``commlayer.config.describe``, ``from commlayer.errors import ...``), and the core/ paths of
# the modules that moved down to common/ (``commlayer.core.errors``): the same module objects.
from commlayer import core as _core  # noqa: E402
from commlayer.common import errors as _errors  # noqa: E402
from commlayer.common import reduce_ops as _reduce_ops  # noqa: E402
from commlayer.common import topology as _topology  # noqa: E402
from commlayer.core import future as _future  # noqa: E402
from commlayer.core import process_sets as _process_sets  # noqa: E402

for _module in (config, _errors, _future, _process_sets, _reduce_ops, _runtime):
    _name = _module.__name__.rpartition(".")[2]
    _sys.modules.setdefault(f"commlayer.{_name}", _module)
    globals().setdefault(_name, _module)
for _module in (config, _errors, _reduce_ops, _topology):
    _name = _module.__name__.rpartition(".")[2]
    _sys.modules.setdefault(f"commlayer.core.{_name}", _module)
    setattr(_core, _name, _module)


def mpi_built() -> bool:
    """Whether the MPI backend can run here: mpi4py imports (commlayer runs over MPI, or over
    torch.distributed under torchrun: COMMLAYER_BACKEND)."""
    return _find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """Whether the running engine's messages travel over MPI (False before init())."""
    return _runtime.backend_name() == "mpi"


def mpi_threads_supported() -> bool:
    """The engine makes every MPI call from one thread, so any thread level works."""
    return True


def gloo_built() -> bool:
    """torch.distributed's gloo carries the engine under torchrun (COMMLAYER_BACKEND=torch)."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_gloo_available())


def gloo_enabled() -> bool:
    """Whether the running engine's messages travel over torch.distributed (gloo; False before
    init())."""
    return _runtime.backend_name() == "torch"


def nccl_built() -> int:
    """NCCL's version code as Horovod returns it (NCCL_VERSION_CODE: 22703 for 2.27.3), or 0.

    Non-zero when torch.distributed has NCCL and a GPU is here (``cuda_built()`` or
    ``rocm_built()``, whose NCCL is RCCL): the torch backend then moves CUDA tensors over NCCL
    directly (under torchrun; COMMLAYER_NCCL), and DDP's hook runs over it. Scripts written for
    Horovod test it as a bool."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available() and (cuda_built() or rocm_built())):
        return 0
    major, minor, patch = _torch.cuda.nccl.version()[:3]
    if (major, minor) <= (2, 8):  # NCCL's own NCCL_VERSION(X, Y, Z) macro
        return int(major * 1000 + minor * 100 + patch)
    return int(major * 10000 + minor * 100 + patch)


def ddl_built() -> bool:
    """IBM DDL: commlayer has no DDL path."""
    return False


def ccl_built() -> bool:
    """Intel oneCCL: commlayer has no oneCCL path."""
    return False


def cuda_built() -> bool:
    """Whether collectives, DistributedOptimizer and DDP's hook take CUDA tensors here: torch was
    built with CUDA and sees a GPU. Such tensors are staged through pinned host memory, or taken
    by the backend directly where it can (NCCL under torchrun, a CUDA-aware MPI: commlayer/
    device.py). (Horovod: compiled with CUDA. The CUDA compression kernels need no CUDA build of
    commlayer.)"""
    return _torch.version.cuda is not None and _torch.cuda.is_available()


def rocm_built() -> bool:
    """As ``cuda_built()`` for a torch built for ROCm (HIP) that sees a GPU: torch presents its
    devices as ``cuda`` ones, and the collectives take them the same way (not tested on ROCm
    here)."""
    return _torch.version.hip is not None and _torch.cuda.is_available()


def allreduce_algorithm() -> str:
    """The algorithm the running engine reduces every allreduce with (``auto`` or a name of
    ``commlayer.algorithms.available()``): init(allreduce_algorithm=...) or
    COMMLAYER_ALLREDUCE_ALGORITHM, the same on every rank. NotInitializedError before init()."""
    return _runtime.engine().config.allreduce_algorithm


# The public API: every function, class and constant above, and the two subpackages Horovod's
# users reach through hvd (hvd.elastic.run, hvd.compression); not the submodules the imports
# above bring in as attributes (runtime, config, ops, core, ...), which are internal.
__all__ = [
    name
    for name, value in dict(globals()).items()
    if not name.startswith("_")
    and (not isinstance(value, _types.ModuleType) or name in ("elastic", "compression"))
]
