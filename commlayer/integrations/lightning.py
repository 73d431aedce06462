"""Lightning strategy: train a LightningModule with commlayer's DistributedOptimizer.

```python
from commlayer.integrations.lightning import CommlayerStrategy
trainer = lightning.pytorch.Trainer(strategy=CommlayerStrategy(), accelerator="cpu", devices=1)
```
launched as ``commlayerrun -np 2 python train.py`` (one process per rank, as Horovod's strategy
in Lightning 1.x was). Needs ``pip install "commlayer[lightning]"``.

1. ``setup_environment`` starts commlayer (``commlayer.init()``) unless the script did.
2. ``setup`` broadcasts the module's parameters and the optimizers' state from rank 0, then wraps
   each optimizer in :class:`commlayer.DistributedOptimizer` (``compression`` as given), kept in
   ``skip_synchronize()`` for the whole fit: Lightning calls ``step(closure)`` *before* the
   closure runs forward and backward, so the reduction cannot wait in ``step``.
3. ``post_backward`` (inside the closure, after backward) calls ``synchronize()``: ``step`` then
   updates with averaged gradients.
4. ``reduce`` / ``all_gather`` / ``broadcast`` / ``barrier`` (``self.log(..., sync_dist=True)``,
   checkpoint decisions) use commlayer's collectives.

Not supported: ``accumulate_grad_batches > 1`` (a ValueError; DistributedOptimizer's
``backward_passes_per_step`` would need Lightning to skip ``post_backward``), process groups
other than the world, GPU devices (commlayer moves CPU tensors).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy

import commlayer as cl
from commlayer.compression import Compressor


class CommlayerStrategy(ParallelStrategy):
    """Data parallel training over commlayer (see the module docstring for the steps)."""

    strategy_name = "commlayer"

    def __init__(self, compression: str | Compressor | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.compression = compression
        self._exit_stack: contextlib.ExitStack | None = None

    # -- who am I ---------------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return cl.rank() if cl.is_initialized() else 0

    @property
    def local_rank(self) -> int:
        return cl.local_rank() if cl.is_initialized() else 0

    @property
    def node_rank(self) -> int:
        return cl.cross_rank() if cl.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return cl.size() if cl.is_initialized() else 1

    @property
    def is_distributed(self) -> bool:  # read by Lightning for custom strategies (samplers)
        return True

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        if not cl.is_initialized():
            cl.init()
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        super().setup_environment()

    # -- training ---------------------------------------------------------------------------------
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: Any) -> None:
        self.model_to_device()
        super().setup(trainer)
        if not trainer.training:
            return
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"CommlayerStrategy: accumulate_grad_batches={trainer.accumulate_grad_batches!r}"
                " is not supported; allowed: 1"
            )
        module = self.lightning_module
        assert module is not None
        cl.broadcast_parameters(module.state_dict(), root_rank=0)
        wrapped = []
        for optimizer in self.optimizers:
            optimizer = (
                optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            )
            cl.broadcast_optimizer_state(optimizer, root_rank=0)
            mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
            named = [(n, p) for n, p in module.named_parameters() if id(p) in mine]
            wrapped.append(
                cl.DistributedOptimizer(
                    optimizer, named_parameters=named, compression=self.compression
                )
            )
        self.optimizers = wrapped
        self._exit_stack = contextlib.ExitStack()
        for optimizer in wrapped:
            self._exit_stack.enter_context(optimizer.skip_synchronize())  # type: ignore[attr-defined]

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        for optimizer in self.optimizers:
            if hasattr(optimizer, "synchronize"):
                optimizer.synchronize()

    def teardown(self) -> None:
        if self._exit_stack is not None:
            self._exit_stack.close()
            self._exit_stack = None
        super().teardown()

    # -- collectives ------------------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        if cl.is_initialized():
            cl.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return cl.broadcast_object(obj, root_rank=src) if cl.is_initialized() else obj

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or not cl.is_initialized():
            return tensor
        if group is not None:
            raise ValueError(f"CommlayerStrategy.reduce(group={group!r}): allowed None (world)")
        op = str(getattr(reduce_op, "value", reduce_op) or "mean").lower()
        ops = {"mean": cl.Average, "avg": cl.Average, "sum": cl.Sum, "max": cl.Max, "min": cl.Min}
        if op not in ops:
            raise ValueError(
                f"CommlayerStrategy.reduce(reduce_op={reduce_op!r}): allowed {sorted(ops)}"
            )
        return cl.allreduce(tensor.detach().cpu(), op=ops[op])

    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        if not cl.is_initialized():
            return tensor.unsqueeze(0)
        return cl.allgather(tensor.detach().cpu().unsqueeze(0))  # (world_size, *shape), as DDP's
