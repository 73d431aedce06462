"""DistributedOptimizer: wrap any torch.optim optimizer so gradients are averaged across ranks.

1. A hook per parameter (``register_post_accumulate_grad_hook``) counts the gradient ready the
   moment backward has finished accumulating it, so communication of the last layers overlaps
   the backward pass of the first ones. The bucketer here is commlayer's one batching policy
   (the engine executes what it is given, engine.py constraint 3): in the first step, ready
   gradients wait until ``min_bucket_bytes`` (COMMLAYER_MIN_BUCKET_BYTES, 1 MiB) of them are
   ready or the step's last one is, then go together (``ops.batch``: negotiated and fused in
   one cycle). That step records the order in which backward made them ready; at its end rank
   0's order is broadcast, and from then on gradients travel in fixed buckets, as DDP's do:
   ``min_bucket_bytes`` of gradients of one dtype and one compressor, in that order, reduced
   together by the compression communicator as soon as the bucket's last gradient is ready. A
   hook is then a counter: on the ResNet of benchmarks/train.py the 47 per-gradient
   submissions cost ~110 us each during backward (12 us alone: backward leaves Python's caches
   cold), 5 ms a step. Sparse gradients and parameters added later go one by one.
2. ``step()`` waits only for what is still in flight (``synchronize``), then runs the wrapped
   optimizer's own step. Reading ``param_groups`` while reductions are in flight synchronizes
   first, so ``torch.amp.GradScaler`` (whose ``unscale_`` and inf check read every gradient
   through it) sees reduced gradients and every rank takes the same skip-or-step decision.
   Parameters that got no gradient this step (frozen branch, unused layer, ``requires_grad``
   toggled) are submitted at ``synchronize`` with zeros, on every rank, so no rank waits for a
   gradient another rank never produces.
3. ``backward_passes_per_step=k`` accumulates k backward passes locally and reduces once.
4. Compression (``compression=``: a compressor, a spec such as ``"topk:ratio=0.01"``, a
   ``compression.Policy``, or None for the ``compression`` init() resolved, default
   COMMLAYER_COMPRESSION): the policy picks a compressor per gradient, and how its payload
   travels is the communicator's business (compression/communicator.py: allreduce for
   summable payloads, PowerSGD's rounds chained as they complete, one gathered record for the
   others, or the configured sparse algorithm for top-k). The compressors' state
   (error-feedback residuals, keyed by gradient name) travels in ``state_dict()``.
5. The wrapper is a dynamic subclass of the optimizer's own class that shares the original
   object's state, so ``isinstance``, ``param_groups``, ``state_dict``, ``add_param_group``, LR
   schedulers, step hooks and custom subclasses keep working; LBFGS is refused (its closure
   re-evaluates gradients many times per step).
6. Over one rank (a process set of size 1: ``size()`` is 1, or a set of this rank alone) the
   average is the gradient itself, and, as Horovod, which registers no hooks at size 1, the
   wrapper is the identity: no hook, no bucket, no compression, nothing submitted or waited
   for; ``step()`` is the wrapped optimizer's, gradients accumulate over backward passes as
   they would unwrapped, and ``synchronize()`` only marks the step as synchronized (so
   ``step()`` after it warns, as Horovod's does). ``COMMLAYER_FORCE_FULL_PATH=1`` takes the
   whole path there too, for benchmarks and tests. Ranks outside the process set are identity
   wrappers too (Horovod: their gradients stay local).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from commlayer import ops
from commlayer.comm.communicator import Communicator, EngineTransport, measure_cpu
from commlayer.compression import Compressor, Policy, create
from commlayer.compression import auto as auto_compression
from commlayer.compression.auto import AutoCompressor, Link
from commlayer.core import runtime
from commlayer.core.errors import CommlayerError, TensorMismatchError
from commlayer.core.future import Future
from commlayer.core.process_sets import ProcessSet, global_process_set
from commlayer.core.reduce_ops import ReduceOp

_log = logging.getLogger("commlayer")
_COMPRESSION_STATE = "commlayer_compression"  # state_dict() key of the compressors' state


class _Bucket:
    """Gradients reduced as one grouped allreduce once the last of them is ready."""

    __slots__ = ("params", "name", "compressor", "ready", "handle")

    def __init__(self, params: list[torch.nn.Parameter], name: str, compressor: Compressor) -> None:
        self.params = params
        self.name = name
        self.compressor = compressor  # the policy's choice for every member
        self.ready = 0  # parameters whose gradient is final this step
        self.handle: Future | None = None  # while its reduction is in flight


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the dynamic subclass (see ``DistributedOptimizer``)."""

    # In flight since the last synchronize: a parameter's future, and whether its gradient
    # is sparse (rows to sum into p.grad); dense ones are reduced in p.grad itself.
    _cl_handles: dict[torch.nn.Parameter, tuple[Future, bool]]

    def _cl_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
        compression: Policy,
        backward_passes_per_step: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        sparse_as_dense: bool,
        process_set: ProcessSet,
    ) -> None:
        if backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}"
            )
        if gradient_predivide_factor <= 0:
            raise ValueError(
                f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}"
            )
        if gradient_predivide_factor != 1.0 and op != ReduceOp.Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        # Over one rank the wrapper is the identity (module docstring, 6.), whatever the op
        # (Horovod's too: at size 1 it wraps even op=Adasum in its plain optimizer).
        alone = process_set.size() == 1 and runtime.config().force_full_path != "1"
        if op == ReduceOp.Adasum and not alone:
            raise ValueError(
                f"rank {runtime.rank()}: DistributedOptimizer(op=Adasum) is not supported: "
                "Horovod applies Adasum to each "
                "step's parameter change in an optimizer of its own; use op=Average or op=Sum, "
                "or commlayer.allreduce(tensor, op=Adasum) on what you want combined"
            )
        self._cl_named = _name_map(named_parameters)
        params = [p for group in self.param_groups for p in group["params"]]
        self._cl_names = _parameter_names(params, self._cl_named)
        self._cl_policy = _checked_policy(compression, op, self._cl_names, self._cl_named)
        self._cl_comm = Communicator(
            EngineTransport(process_set, runtime.config().sparse_algorithm),
            op,
            gradient_predivide_factor,
            what="gradient",
        )
        self._cl_passes_per_step = backward_passes_per_step
        self._cl_op = op
        self._cl_sparse_as_dense = sparse_as_dense
        self._cl_process_set = process_set
        self._cl_handles = {}
        self._cl_passes: dict[torch.nn.Parameter, int] = {}
        self._cl_ready = 0  # parameters whose gradient is final since the last synchronize
        self._cl_bucket_bytes = runtime.config().min_bucket_bytes
        self._cl_buckets: list[_Bucket] = []
        self._cl_bucket_of: dict[torch.nn.Parameter, _Bucket] = {}
        # Gradients ready but not in a bucket (the first step, sparse ones, parameters added
        # later), sent together once they hold min_bucket_bytes, or at the step's last one.
        self._cl_unsent: list[torch.nn.Parameter] = []
        self._cl_unsent_bytes = 0
        # Ready order of this step's gradients, recorded until the buckets are planned.
        self._cl_order: list[torch.nn.Parameter] | None = []
        # sparse_dim of parameters seen with a sparse gradient: when such a parameter has no
        # gradient on this rank, it joins the others' allgather with zero rows.
        self._cl_sparse_dims: dict[torch.nn.Parameter, int] = {}
        self._cl_synchronized = False
        self._cl_user_synchronized = False  # synchronize() called by the user since the step
        self._cl_should_synchronize = True
        # Gradients that were sparse and were reduced dense (sparse_as_dense, or dense in the
        # step that planned the buckets): given back sparse, as backward made them.
        self._cl_resparsify: set[torch.nn.Parameter] = set()
        # Whether this rank reduces at all (module docstring, 6.): as in Horovod, ranks outside
        # the optimizer's process set do not (their gradients stay local), nor does a set of one
        # rank, unless COMMLAYER_FORCE_FULL_PATH says to; synchronize() then returns at once.
        self._cl_reduces = process_set.included() and not alone
        # Seconds step()/synchronize() spent blocked on reductions: the collective time that
        # passed meanwhile (communication_stats()["collective_now_s"] before and after: what
        # backward did not hide) plus the wait outside collectives (negotiation, queueing).
        self.synchronize_wait_s = 0.0
        self._cl_hooks: list[Any] = []
        self._cl_hook(params)

    @property
    def _parameter_names(self) -> dict[torch.nn.Parameter, str]:
        """{parameter: name} (horovod.torch's attribute): the names of named_parameters, else
        'grad.<position>' names, the same on every rank."""
        return {p: name.removeprefix("grad.") for p, name in self._cl_names.items()}

    def _cl_hook(self, params: list[torch.nn.Parameter]) -> None:
        """Submit each parameter's gradient as soon as backward has accumulated it."""
        if not self._cl_reduces:
            return
        self._cl_hooks += [
            p.register_post_accumulate_grad_hook(self._cl_on_grad_ready)
            for p in params
            if p.requires_grad
        ]

    # -- backward side ---------------------------------------------------------------------------
    def _cl_on_grad_ready(self, p: torch.nn.Parameter) -> None:
        passes = self._cl_passes.get(p, 0) + 1
        if passes > self._cl_passes_per_step:
            raise RuntimeError(
                f"gradient of {self._cl_names[p]!r} was computed again before step(): call "
                "optimizer.step() (or synchronize()) after every backward pass, or set "
                "backward_passes_per_step"
            )
        self._cl_synchronized = self._cl_user_synchronized = False
        self._cl_passes[p] = passes
        if passes < self._cl_passes_per_step:
            return
        self._cl_ready += 1
        bucket = self._cl_bucket_of.get(p)
        if bucket is not None:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._cl_send_bucket(bucket)
        else:
            if self._cl_order is not None:
                self._cl_order.append(p)
            self._cl_unsent.append(p)
            self._cl_unsent_bytes += p.numel() * p.element_size()
            if self._cl_unsent_bytes >= self._cl_bucket_bytes:
                self._cl_send_unsent()
        if self._cl_ready == len(self._cl_hooks):
            # the step's last gradient: no company is coming, send now rather than at
            # step() (one negotiation round later, ~5% of an MLP step at 4 ranks)
            self._cl_send_unsent()

    def _cl_send_unsent(self) -> None:
        """Submit the gradients waiting outside buckets, together (the engine negotiates and
        fuses what arrives together), instead of one collective per small gradient."""
        unsent, self._cl_unsent, self._cl_unsent_bytes = self._cl_unsent, [], 0
        with ops.batch():
            for p in unsent:
                self._cl_submit(p)

    def _cl_submit(self, p: torch.nn.Parameter) -> None:
        grad = p.grad
        if grad is None:
            grad = p.grad = self._cl_empty_grad(p)
        if grad.is_sparse:
            if not self._cl_sparse_as_dense:
                self._cl_handles[p] = (self._cl_sparse_submit(p, grad), True)
                return
            grad = p.grad = grad.to_dense()
            self._cl_resparsify.add(p)
        name = self._cl_names[p]
        compressor = self._cl_policy.choose(name.removeprefix("grad."), grad)
        self._cl_handles[p] = (self._cl_comm.reduce([grad], compressor, name), False)

    def _cl_send_bucket(self, bucket: _Bucket) -> None:
        """The bucket's gradients reduced together (the communicator: one grouped allreduce
        uncompressed, one collective a round compressed), in place. At synchronize a member
        whose gradient backward did not produce contributes its ``grad`` (``_cl_empty_grad``
        if None, as ``_cl_submit`` does: zeros, a bucketed gradient is never known-sparse), or,
        if it no longer requires grad, zeros that go nowhere: every rank sends the same
        bucket."""
        grads = []
        for p in bucket.params:
            grad = p.grad
            if grad is None or not p.requires_grad:
                grad = self._cl_empty_grad(p)
                if p.requires_grad:
                    p.grad = grad
            elif grad.is_sparse:  # sparse now, dense in the recorded step: reduce it dense
                grad = p.grad = grad.to_dense()
                self._cl_resparsify.add(p)
            grads.append(grad)
        names = [self._cl_names[p] for p in bucket.params]
        bucket.handle = self._cl_comm.reduce(grads, bucket.compressor, bucket.name, names)

    def _cl_empty_grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        """What a rank without a gradient for ``p`` contributes: no rows of a known-sparse
        gradient, else zeros."""
        sparse_dim = self._cl_sparse_dims.get(p)
        if sparse_dim is None or self._cl_sparse_as_dense:
            return torch.zeros_like(p)
        indices = torch.empty((sparse_dim, 0), dtype=torch.int64)
        values = torch.empty((0, *p.shape[sparse_dim:]), dtype=p.dtype)
        return torch.sparse_coo_tensor(indices, values, p.shape)

    def _cl_sparse_submit(self, p: torch.nn.Parameter, grad: torch.Tensor) -> Future:
        """Sparse gradients: one allgather of every rank's rows (index, value) packed as bytes;
        the sum of the gathered sparse tensor reduces duplicates. One operation with the
        parameter's own name: a rank that has no gradient and has never seen this parameter's
        gradient sparse submits a dense allreduce of that name, which negotiation reports as a
        mismatch on every rank (TensorMismatchError) instead of a hang."""
        grad = grad.coalesce()
        self._cl_sparse_dims[p] = grad.sparse_dim()
        nnz = grad.values().shape[0]
        index_rows = _byte_rows(grad.indices().t(), nnz)
        rows = torch.cat([index_rows, _byte_rows(grad.values(), nnz)], dim=1)
        return ops.allgather_async(rows, name=self._cl_names[p], process_set=self._cl_process_set)

    # -- step side ---------------------------------------------------------------------------------
    def _cl_new_world(self) -> None:
        """Elastic training re-formed the world (commlayer/elastic): what was in flight is
        gone, the buckets are planned again from the next step's order (as a new worker plans
        its own: every rank alike), and whether this rank reduces follows the new size."""
        alone = self._cl_process_set.size() == 1 and runtime.config().force_full_path != "1"
        self._cl_reduces = self._cl_process_set.included() and not alone
        self._cl_handles.clear()
        self._cl_passes.clear()
        self._cl_ready = 0
        self._cl_buckets, self._cl_bucket_of = [], {}
        self._cl_unsent, self._cl_unsent_bytes = [], 0
        self._cl_order = []
        self._cl_resparsify.clear()

    def synchronize(self) -> None:
        """Wait for every gradient's reduction and write the results into ``p.grad``. Then
        call ``step()`` inside ``skip_synchronize()`` (as in Horovod; without it, step()
        warns)."""
        self._cl_synchronize()
        self._cl_user_synchronized = True

    def _cl_synchronize(self) -> None:
        if not self._cl_reduces:
            self._cl_synchronized = True
            return
        self._cl_send_unsent()
        late = []  # gradients backward did not produce: submitted now, zeros if None
        with ops.batch():
            for group in self.__dict__["param_groups"]:  # not the property: it synchronizes
                for p in group["params"]:
                    if (
                        p.requires_grad
                        and p not in self._cl_handles
                        and p not in self._cl_bucket_of
                    ):
                        self._cl_submit(p)
                        late.append(p)
            for bucket in self._cl_buckets:
                # A bucket of parameters that all stopped requiring grad stays home, as a
                # frozen parameter does on the path one by one.
                if bucket.handle is None and any(p.requires_grad for p in bucket.params):
                    self._cl_send_bucket(bucket)
        start = time.perf_counter()
        failure = self._cl_wait_buckets()
        # Every future is waited for even after one failed, so that none is left in flight
        # (its name would be a duplicate at the next step) and the error is raised once.
        for p, (future, sparse) in self._cl_handles.items():
            try:
                result = future.wait()
                if sparse:
                    p.grad = self._cl_sparse_result(p, result)
            except CommlayerError as exc:
                failure = failure or _with_hint(exc, self._cl_names[p])
        self.synchronize_wait_s += time.perf_counter() - start
        for p in self._cl_resparsify:
            if p.grad is not None and not p.grad.is_sparse:
                p.grad = p.grad.to_sparse()
        self._cl_resparsify.clear()
        self._cl_handles.clear()
        self._cl_passes.clear()
        self._cl_ready = 0
        if failure is not None:
            if self._cl_order is not None:
                self._cl_order = []  # record the next step's order instead
            raise failure
        if self._cl_order is not None:
            self._cl_plan_buckets(self._cl_order, late)
        self._cl_synchronized = True

    def _cl_wait_buckets(self) -> CommlayerError | None:
        """Wait for every bucket in flight (the results are written in place); returns the
        first error, whose operation name (``grad.bucket[first..last]``) names the bucket's
        first and last gradients."""
        failure = None
        for bucket in self._cl_buckets:
            handle, bucket.handle, bucket.ready = bucket.handle, None, 0
            if handle is None:
                continue
            try:
                handle.wait()
            except CommlayerError as exc:
                failure = failure or exc
        return failure

    def _cl_plan_buckets(
        self, ready: list[torch.nn.Parameter], late: list[torch.nn.Parameter]
    ) -> None:
        """After the first complete step (on every rank alike: a collective): buckets in rank
        0's ready order. Sparse gradients stay on their own path; parameters that got no
        gradient come last, in buckets of their own."""
        self._cl_order = None
        names = [self._cl_names[p] for p in ready + late if p not in self._cl_sparse_dims]
        split = sum(1 for p in ready if p not in self._cl_sparse_dims)
        from commlayer import state_sync  # imports the ops layer, as this module does

        root = min(self._cl_process_set.ranks or [0])  # the set's first rank (a global rank)
        by_name = {name: p for p, name in self._cl_names.items()}
        compressor_of = {
            p: self._cl_policy.choose(name.removeprefix("grad."), p)
            for p, name in self._cl_names.items()
        }
        autos = [c for c in self._cl_policy.compressors().values() if isinstance(c, AutoCompressor)]
        # compression="auto": every rank times the link now (a collective), rank 0 decides
        # each bucket's compressor and its decisions travel with the plan (compression/auto.py).
        link = self._cl_measure_link() if autos else None
        decisions = None
        if link is not None and runtime.rank() == root:
            decisions = self._cl_decide(self._cl_plan(names, split, by_name, compressor_of), link)
        names, split, decisions = state_sync.broadcast_object(
            (names, split, decisions),
            root,
            name=f"{next(iter(self._cl_names.values()))}.bucket_plan",
            process_set=self._cl_process_set,
        )
        for index, params in enumerate(self._cl_plan(names, split, by_name, compressor_of)):
            first, last = (self._cl_names[p].removeprefix("grad.") for p in (params[0], params[-1]))
            compressor = compressor_of[params[0]]
            if isinstance(compressor, AutoCompressor):
                spec = decisions[index] if decisions is not None else None
                if spec is None:
                    raise CommlayerError(
                        f"rank {runtime.rank()}: compression='auto' here but rank {root} sent no "
                        f"decision for bucket {index}: every rank must pass the same compression"
                    )
                compressor = compressor.compressor(spec, runtime.rank())
            name = f"grad.bucket[{first}..{last}]"
            self._cl_buckets.append(_Bucket(params, name, compressor))
        self._cl_bucket_of = {p: b for b in self._cl_buckets for p in b.params}

    def _cl_plan(
        self,
        names: list[str],
        split: int,
        by_name: dict[str, torch.nn.Parameter],
        compressor_of: dict[torch.nn.Parameter, Compressor],
    ) -> list[list[torch.nn.Parameter]]:
        """The buckets of a plan: the gradients backward made ready, then the late ones."""
        buckets: list[list[torch.nn.Parameter]] = []
        for part in (names[:split], names[split:]):
            members = [by_name[name] for name in part]
            buckets += _bucket_plan(members, self._cl_bucket_bytes, compressor_of)
        return buckets

    def _cl_measure_link(self) -> Link:
        """The engine's allreduce time over this process set, ``alpha + beta B``, from the
        fastest of a few blocking allreduces at two sizes (every rank: a collective)."""
        prefix = f"{next(iter(self._cl_names.values()))}.auto_link"
        points = []
        for nbytes in auto_compression.LINK_SIZES:
            buffer = torch.zeros(nbytes // 4)
            best = math.inf
            for repeat in range(auto_compression.LINK_REPEATS):
                start = time.perf_counter()
                ops.allreduce_(
                    buffer, name=f"{prefix}.{nbytes}.{repeat}", op=ReduceOp.Sum,
                    process_set=self._cl_process_set,
                )  # fmt: skip
                best = min(best, time.perf_counter() - start)
            points.append((nbytes, best))
        return Link.fit(points, self._cl_process_set.size())

    def _cl_decide(self, buckets: list[list[torch.nn.Parameter]], link: Link) -> list[str | None]:
        """Rank 0: each bucket's spec where the policy said auto (None elsewhere)."""
        size = self._cl_process_set.size()
        out: list[str | None] = [None] * len(buckets)
        by_auto: dict[int, list[int]] = {}
        for index, params in enumerate(buckets):
            chosen = self._cl_policy.choose(
                self._cl_names[params[0]].removeprefix("grad."), params[0]
            )
            if isinstance(chosen, AutoCompressor):
                by_auto.setdefault(id(chosen), []).append(index)
        autos = {
            id(c): c
            for c in self._cl_policy.compressors().values()
            if isinstance(c, AutoCompressor)
        }
        for key, indices in by_auto.items():
            auto = autos[key]
            used = self._cl_calibrated_link(link) if auto.link == "calibration" else link
            grads = [
                [p.grad if p.grad is not None and not p.grad.is_sparse else torch.zeros_like(p)
                 for p in buckets[i]]
                for i in indices
            ]  # fmt: skip
            for i, spec in zip(
                indices, auto_compression.plan(auto, grads, used, size, measure_cpu)
            ):
                out[i] = spec
        return out

    def _cl_calibrated_link(self, measured: Link) -> Link:
        """``auto:link=calibration``: the stored calibration for these ranks and nodes, else
        the measured link (logged)."""
        from commlayer import costmodel

        nodes = ops.topology(self._cl_process_set).nodes
        cal = costmodel.load(self._cl_process_set.size(), nodes)
        if cal is None or (nodes > 1 and not cal.has_inter):
            _log.info(
                "commlayer: compression auto:link=calibration: no calibration for %d ranks on "
                "%d node(s) (run `commlayer calibrate`); using the link measured now",
                self._cl_process_set.size(), nodes,
            )  # fmt: skip
            return measured
        return Link.from_calibration(cal)

    def compression_decisions(self) -> list[dict[str, Any]]:
        """What ``compression="auto"`` chose, one entry per bucket class (rank 0's decisions,
        kept on rank 0; empty before the second step and without auto): the choice, the
        bucket's bytes and tensors, the predicted seconds and measured CPU seconds of each
        candidate, and the link it was decided for."""
        return [
            d
            for c in self._cl_policy.compressors().values()
            if isinstance(c, AutoCompressor)
            for d in c.decisions
        ]

    def _cl_sparse_result(self, p: torch.nn.Parameter, rows: torch.Tensor) -> torch.Tensor:
        """Unpack the gathered (index, value) rows and sum duplicates."""
        sparse_dim = self._cl_sparse_dims[p]
        divisor = self._cl_process_set.size() if self._cl_op == ReduceOp.Average else 1
        split = 8 * sparse_dim  # int64 index bytes per row
        indices = rows[:, :split].contiguous().view(torch.int64)
        values = rows[:, split:].contiguous().view(p.dtype).reshape(-1, *p.shape[sparse_dim:])
        summed = torch.sparse_coo_tensor(
            indices.t(), values / divisor, p.shape, check_invariants=False
        )
        return summed.coalesce()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``with opt.skip_synchronize(): opt.step()`` after an explicit ``synchronize()``."""
        self._cl_should_synchronize = False
        try:
            yield
        finally:
            self._cl_should_synchronize = True

    def step(self, closure: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        if self._cl_should_synchronize:
            if self._cl_user_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(): use `with optimizer.skip_synchronize(): "
                    "optimizer.step()` after an explicit synchronize() (commlayer does not "
                    "reduce twice, Horovod would)",
                    stacklevel=2,
                )
            if not self._cl_synchronized:
                self._cl_synchronize()
        self._cl_synchronized = self._cl_user_synchronized = False
        self._opt_called = True  # what an LR scheduler's patch of step notes (DistributedOptimizer)
        # super(self.__class__, ...): these methods are copied onto a class made with type(), so
        # zero-argument super() would name _DistributedOptimizer, which self is not.
        parent: Any = super(self.__class__, self)
        return parent.step(closure, **kwargs) if closure is not None or kwargs else parent.step()

    def _cl_param_groups(self) -> list[dict[str, Any]]:
        # Whoever reads the gradients through the optimizer (GradScaler.unscale_ and its inf
        # check, clipping helpers) must see reduced ones: finish the reductions first.
        if self.__dict__.get("_cl_ready"):
            self._cl_synchronize()
        return self.__dict__["param_groups"]  # type: ignore[no-any-return]

    def _cl_set_param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.__dict__["param_groups"] = groups

    param_groups = property(_cl_param_groups, _cl_set_param_groups)  # type: ignore[assignment]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A group added after wrapping (a layer unfrozen for fine-tuning) is named and hooked
        like the others; without a name its gradient could not be reduced."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        names = _parameter_names(params, self._cl_named, first_index=len(self._cl_names))
        param_group["params"] = params
        super(self.__class__, self).add_param_group(param_group)
        self._cl_names.update(names)
        self._cl_hook(params)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, plus this rank's compressor state (error-feedback
        residuals differ per rank: each rank saves its own to restart exactly)."""
        state: dict[str, Any] = super(self.__class__, self).state_dict()
        compression = self._cl_policy.state_dict()
        if compression:
            rank = runtime.rank() if runtime.is_initialized() else 0
            state[_COMPRESSION_STATE] = {"rank": rank, "compressors": compression}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Residuals are restored only on the rank that saved them: loaded on another
        (``broadcast_optimizer_state``, one checkpoint for all) they would be counted twice."""
        state_dict = dict(state_dict)
        saved = state_dict.pop(_COMPRESSION_STATE, None)
        super(self.__class__, self).load_state_dict(state_dict)
        rank = runtime.rank() if runtime.is_initialized() else 0
        if saved is not None and saved["rank"] == rank:
            self._cl_policy.load_state_dict(saved["compressors"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._cl_ready:
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): the reductions in flight would be "
                "lost"
            )
        super(self.__class__, self).zero_grad(set_to_none)


# Optimizer.__setstate__ (run by load_state_dict, so by broadcast_optimizer_state on every rank
# but the root) wraps type(self).step in the step-hook runner unless it is marked as hooked. The
# wrapped class's own step already runs the hooks around the real step, so mark ours: otherwise
# every step pre/post hook ran twice per step after load_state_dict.
_DistributedOptimizer.step.hooked = True  # type: ignore[attr-defined]


def _bucket_plan(
    params: list[torch.nn.Parameter],
    bucket_bytes: int,
    compressor_of: dict[torch.nn.Parameter, Compressor] | None = None,
) -> list[list[torch.nn.Parameter]]:
    """``params`` in order, per dtype and compressor, cut into buckets of at least
    ``bucket_bytes`` (the last of each kind may be smaller; 0: one parameter a bucket)."""
    buckets: list[list[torch.nn.Parameter]] = []
    filling: dict[tuple[torch.dtype, int], list[torch.nn.Parameter]] = {}
    filled: dict[tuple[torch.dtype, int], int] = {}
    for p in params:
        key = (p.dtype, id(compressor_of[p]) if compressor_of else 0)
        filling.setdefault(key, []).append(p)
        filled[key] = filled.get(key, 0) + p.numel() * p.element_size()
        if filled[key] >= bucket_bytes:
            buckets.append(filling.pop(key))
            del filled[key]
    return buckets + list(filling.values())


def _name_map(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
) -> dict[torch.nn.Parameter, str] | None:
    """{parameter: name} from named_parameters (validated), or None when none were given."""
    if named_parameters is None:
        return None
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError(
            "named_parameters must be an iterable of (name, parameter) pairs, "
            "e.g. model.named_parameters()"
        )
    names = [name for name, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"named_parameters has duplicate names: {duplicates}")
    return {p: name for name, p in named}


def _parameter_names(
    params: list[torch.nn.Parameter],
    by_param: dict[torch.nn.Parameter, str] | None,
    first_index: int = 0,
) -> dict[torch.nn.Parameter, str]:
    """Each parameter's operation name: from named_parameters, else its position."""
    if by_param is None:
        return {p: f"grad.{first_index + i}" for i, p in enumerate(params)}
    missing = [i for i, p in enumerate(params) if p not in by_param]
    if missing:
        raise ValueError(
            f"{len(missing)} parameter(s) of the optimizer (positions {missing[:10]}) are not "
            "in named_parameters; pass model.named_parameters() for the same model"
        )
    return {p: f"grad.{by_param[p]}" for p in params}


def DistributedOptimizer(  # noqa: N802 - the Horovod name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: Compressor | str | Policy | None = None,
    backward_passes_per_step: int = 1,
    op: ReduceOp = ReduceOp.Average,
    gradient_predivide_factor: float = 1.0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so ``step()`` applies gradients averaged (``op``) across ranks.

    ``groups`` is accepted for Horovod compatibility; the engine fuses gradients as they become
    ready, which subsumes explicit grouping. ``compression``: ``Compression.fp16``, a spec
    (``"topk:ratio=0.01"``), a ``compression.Policy`` for per-parameter choices, or None for
    ``COMMLAYER_COMPRESSION`` (default ``none``).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "DistributedOptimizer does not support LBFGS: its step() re-evaluates the closure "
            "and gradients several times; average the loss's gradients yourself with allreduce"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    cls: Any = type(
        optimizer.__class__.__name__,
        (optimizer.__class__,),
        {k: v for k, v in _DistributedOptimizer.__dict__.items() if not k.startswith("__")},
    )
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__  # share param_groups, state, defaults, hooks
    patched = optimizer.__dict__.get("step")
    if patched is not None:
        if not getattr(patched, "_wrapped_by_lr_sched", False):
            raise ValueError(
                "optimizer.step was replaced on the optimizer object itself (an attribute, "
                "not its class's method): the wrapper shares the object's attributes, so it "
                "would call that step and never average the gradients; wrap the optimizer "
                "before patching it"
            )
        # An LR scheduler made before wrapping patched the object's own step to note that it
        # was called (``_opt_called``, for its "scheduler stepped before optimizer" warning).
        # On the shared attributes it would run the plain step, without reducing: replaced by
        # the same kind of patch around the wrapper's step (which notes the call itself), so
        # ``step()`` on either object reduces and the scheduler still sees its patch.
        optimizer.__dict__["step"] = _noted_step(wrapped)
    wrapped._cl_setup(
        named_parameters,
        _policy(compression),
        backward_passes_per_step,
        ReduceOp(op),
        gradient_predivide_factor,
        sparse_as_dense,
        process_set,
    )
    return wrapped  # type: ignore[no-any-return]


def _noted_step(wrapped: Any) -> Any:
    """``wrapped.step`` as an LR scheduler's patch of it (``_wrapped_by_lr_sched``), holding
    the wrapper weakly, as torch's patch holds the optimizer."""
    owner = weakref.ref(wrapped)
    step = type(wrapped).step

    @functools.wraps(step)
    def noted(*args: Any, **kwargs: Any) -> Any:
        return step(owner(), *args, **kwargs)

    noted._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return noted


def _policy(compression: Compressor | str | Policy | None) -> Policy:
    """The policy for ``compression`` (None: the ``compression`` init() resolved), its
    compressors told this process's rank (QSGD's rounding noise differs per rank)."""
    rank = runtime.rank()
    if not isinstance(compression, Policy):
        default = runtime.config().compression if compression is None else compression
        return Policy(default, rank=rank)
    for compressor in compression.compressors().values():
        create(compressor, rank=rank)  # binds a compressor made without a rank
    return compression


def _checked_policy(
    policy: Policy,
    op: ReduceOp,
    names: dict[torch.nn.Parameter, str],
    named: dict[torch.nn.Parameter, str] | None,
) -> Policy:
    """Per-parameter choices must name parameters; lossy compressors need Average or Sum."""
    known = set(named.values()) if named is not None else set()
    known |= {name.removeprefix("grad.") for name in names.values()}
    unknown = sorted(set(policy.per_parameter) - known)
    if unknown:
        raise ValueError(
            f"compression per_parameter names {unknown} are not parameters; known: "
            f"{sorted(known)[:20]}"
        )
    lossy = [
        c.name
        for c in policy.compressors().values()
        if not getattr(c, "compresses_small_tensors", False)
    ]
    if lossy and op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(
            f"compression {sorted(set(lossy))} needs op=Average or op=Sum, got {op.name}"
        )
    return policy


def _with_hint(exc: CommlayerError, name: str) -> CommlayerError:
    """A dense/sparse mismatch says how to avoid it."""
    if isinstance(exc, TensorMismatchError) and "operation differs" in str(exc):
        return TensorMismatchError(
            f"{exc}. Gradient {name!r} is sparse on some ranks and missing on others, which "
            "cannot know it is sparse before seeing it once: pass sparse_as_dense=True, or "
            "make every rank use the embedding in the first step"
        )
    return exc


def _byte_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` (first dimension ``rows``) as a (rows, bytes per row) uint8 tensor."""
    width = tensor.element_size() * math.prod(tensor.shape[1:])
    return tensor.contiguous().reshape(-1).view(torch.uint8).reshape(rows, width)
