"""commlayer: communication middleware for distributed training in PyTorch.

``import commlayer as hvd`` works for horovod.torch users: same names, arguments and semantics.
"""

from commlayer import compression, config, elastic
from commlayer import runtime as _runtime
from commlayer.compression import Compression
from commlayer.errors import (
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
from commlayer.future import Future, Handle
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
from commlayer.process_sets import ProcessSet, global_process_set
from commlayer.reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from commlayer.runtime import (
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
)
from commlayer.state_sync import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from commlayer.sync_batch_norm import SyncBatchNorm

__version__ = "0.1.0"


def mpi_built() -> bool:
    """commlayer runs over MPI (mpi4py) or torch.distributed (COMMLAYER_BACKEND)."""
    return True


def mpi_enabled() -> bool:
    """Whether the running engine's messages travel over MPI."""
    return _runtime.backend_name() == "mpi"


def mpi_threads_supported() -> bool:
    """The engine makes every MPI call from one thread, so any thread level works."""
    return True


def gloo_built() -> bool:
    """torch.distributed's gloo carries the engine under torchrun (COMMLAYER_BACKEND=torch)."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_gloo_available())


def gloo_enabled() -> bool:
    """Whether the running engine's messages travel over torch.distributed (gloo)."""
    return _runtime.backend_name() == "torch"


def nccl_built() -> bool:
    """Collectives take CPU tensors only (a GPU tensor is refused with a ValueError)."""
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """Collectives take CPU tensors only; the CUDA compression kernels need no CUDA build."""
    return False


def rocm_built() -> bool:
    return False


def allreduce_algorithm() -> str:
    """The algorithm the running engine reduces every allreduce with (``auto`` or a name of
    ``commlayer.algorithms.available()``): init(allreduce_algorithm=...) or
    COMMLAYER_ALLREDUCE_ALGORITHM, the same on every rank. NotInitializedError before init()."""
    return _runtime.engine().config.allreduce_algorithm


__all__ = [name for name in dir() if not name.startswith("_")]
