"""DistributedOptimizer: wrap any torch.optim optimizer so gradients are averaged across ranks.

1. A hook per parameter (``register_post_accumulate_grad_hook``) counts the gradient ready the
   moment backward has finished accumulating it, so communication of the last layers overlaps
   the backward pass of the first ones. Which gradients then travel together is the Bucketer's
   decision (comm/bucketer.py, commlayer's one bucket policy; the engine executes what it is
   given, engine.py constraint 3): in the first step, ready gradients go together once
   ``min_bucket_bytes`` (COMMLAYER_MIN_BUCKET_BYTES, 1 MiB) of them are ready or the step's
   last one is (``ops.batch``: negotiated and fused in one cycle); at that step's end rank 0's
   ready order is broadcast, and from then on gradients travel in fixed buckets, as DDP's do,
   reduced together by the compression communicator as soon as a bucket's last gradient is
   ready. ``groups=`` (Horovod's) fixes buckets from the start. Sparse gradients go one by
   one, through ``ops.sparse_allreduce_async`` (every rank's entries gathered, summed).
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
   travels is the communicator's business (comm/communicator.py: allreduce for
   summable payloads, PowerSGD's rounds chained as they complete, one gathered record for the
   others, or the configured sparse algorithm for top-k). The compressors' state
   (error-feedback residuals, keyed by gradient name) travels in ``state_dict()``. Across
   hosts a bucket can be compressed once per host (COMMLAYER_COMPRESSION_HIERARCHY,
   comm/hierarchy.py): the host's process sets are registered here, at construction (a
   collective over every rank), and with ``auto`` the plan decides per bucket, from the links
   measured then; a bucket's residual is then kept by its leader, in that rank's state.
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
7. A planned bucket's uncompressed part owns its memory (comm/bucketer.py, 4.): from the plan
   on, ``p.grad`` is a view of the part's flat buffer, backward accumulates into it, and a
   gradient is copied in once, when its part is sent, where ``p.grad`` was something else
   (None after ``zero_grad(set_to_none=True)``, which keeps torch's meaning: ``p.grad`` is
   None after it; or a tensor the user assigned): the hooks stay counters. The part is
   reduced as that one tensor, so after ``step()`` ``p.grad`` is the reduced view. The groups'
   buckets keep the gradients where backward made them (their reduction is one grouped
   operation a part, as Horovod's).
8. With COMMLAYER_WINDOW_BUCKETS (off by default) the plan also asks the engine for a
   shared-memory window (a WINDOW operation on the process set: every rank makes it at the
   same point of its collectives), and those parts' memory is this rank's segment of it
   (comm/bucketer.py ``house_in_window``): each rank reduces its slice reading the other ranks'
   gradients where backward left them and writes it into their buckets (backends/shm.py's
   BucketWindow), no copy in; on several machines (over MPI) a window per machine, each
   slice allreduced across machines before it is written (Allreducer.bucket_window). Where
   the window does not apply (GPU, one rank) the engine answers None on every rank and
   nothing changes. A new plan or a re-formed
   world releases it (``release_window``): the gradients that viewed it become copies.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from commlayer import ops
from commlayer.comm import bucketer as bucket_plan
from commlayer.comm import hierarchy
from commlayer.comm.auto_plan import AutoPlanner
from commlayer.comm.bucketer import Bucket, Bucketer, split_groups
from commlayer.comm.communicator import Communicator, EngineTransport
from commlayer.comm.hierarchy import HostLevels
from commlayer.common.errors import CommlayerError, TensorMismatchError
from commlayer.common.reduce_ops import ReduceOp
from commlayer.compression import Compressor, CompressorBase, Policy, create
from commlayer.core import planned, runtime
from commlayer.core.future import Future
from commlayer.core.negotiation import ALLREDUCE, REGISTER, Registration, dtype_name
from commlayer.core.process_sets import ProcessSet, global_process_set
from commlayer.core.submit import Request, batch, bucket_window, submit

_log = logging.getLogger("commlayer")
_COMPRESSION_STATE = "commlayer_compression"  # state_dict() key of the compressors' state

Param = torch.nn.Parameter
Groups = int | Sequence[Sequence[torch.Tensor]] | None


class _Reducer:
    """What a DistributedOptimizer keeps and does besides the wrapped optimizer's own work, as
    torch DDP's Reducer and PowerSGD's ``PowerSGDState`` keep it: settings, the reductions in
    flight, the Bucketer; auto compression's measuring and deciding at the plan are its
    ``auto`` planner's (comm/auto_plan.py). The optimizer holds it in one attribute
    (``_commlayer``); its own methods (``step``, ``synchronize``, ...) call it."""

    __slots__ = (
        "owner", "named", "names", "policy", "comm", "passes_per_step", "op", "sparse_as_dense",
        "process_set", "reduces", "handles", "passes", "ready", "bucketer", "sparse_dims",
        "resparsify", "hooks", "synchronized", "user_synchronized", "should_synchronize",
        "wait_s", "levels", "auto", "lane", "lane_index", "lane_steps", "window", "__weakref__",
    )  # fmt: skip

    def __init__(
        self,
        owner: dict[str, Any],
        named: dict[Param, str] | None,
        policy: Policy,
        backward_passes_per_step: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        sparse_as_dense: bool,
        process_set: ProcessSet,
    ) -> None:
        self.owner = owner  # the optimizer's __dict__: its param_groups, read without syncing
        self.named = named
        self.names = _parameter_names(self.params(), named)
        self.policy = _checked_policy(policy, op, self.names, named)
        self.process_set = process_set
        # before anything else: on every rank of the job alike (a collective, hierarchy.py)
        self.levels = self.host_levels()
        self.comm = Communicator(
            EngineTransport(process_set, runtime.config().sparse_algorithm),
            op,
            gradient_predivide_factor,
            what="gradient",
            levels=self.levels,
        )
        self.passes_per_step = backward_passes_per_step
        self.op = op
        self.sparse_as_dense = sparse_as_dense
        self.reduces = self.reduces_here()
        # In flight since the last synchronize, outside buckets: a parameter's future, and
        # whether its gradient is sparse (the sum replaces p.grad); dense ones are reduced in
        # p.grad itself.
        self.handles: dict[Param, tuple[Future, bool]] = {}
        self.passes: dict[Param, int] = {}
        self.ready = 0  # parameters whose gradient is final since the last synchronize
        self.bucketer = Bucketer(runtime.config().min_bucket_bytes)
        # sparse_dim of parameters seen with a sparse gradient: when such a parameter has no
        # gradient on this rank, it joins the others' sparse allreduce with no rows.
        self.sparse_dims: dict[Param, int] = {}
        # Gradients that were sparse and were reduced dense (sparse_as_dense, or dense in the
        # step that planned the buckets): given back sparse, as backward made them.
        self.resparsify: set[Param] = set()
        self.hooks: list[Any] = []
        self.synchronized = False
        self.user_synchronized = False  # synchronize() called by the user since the step
        self.should_synchronize = True
        # Seconds step()/synchronize() spent blocked on reductions: the collective time that
        # passed meanwhile (what backward did not hide) plus the wait outside collectives
        # (negotiation, queueing). The optimizer's synchronize_wait_s.
        self.wait_s = 0.0
        # compression=auto's and COMMLAYER_COMPRESSION_HIERARCHY=auto's at the bucket plan
        self.auto = AutoPlanner(self.policy, process_set, self.choose, self.level)
        # COMMLAYER_PLANNED_SKIP_NEGOTIATION: the plan's lane (core/planned.py) and each laned
        # part's index in it, by part name
        self.lane: int | None = None
        self.lane_index: dict[str, int] = {}
        self.lane_steps: list[int] = []  # times each laned part was sent since the plan
        # the shared-memory window the planned buckets live in (COMMLAYER_WINDOW_BUCKETS)
        self.window: Any = None

    def params(self) -> list[Param]:
        return [p for group in self.owner["param_groups"] for p in group["params"]]

    def level(self, compressor: CompressorBase) -> str:
        """Where ``compressor``'s buckets are compressed (hierarchy.mode): flat wherever this
        optimizer has no per-host levels."""
        if self.comm.levels is None:
            return hierarchy.FLAT
        setting = runtime.config().compression_hierarchy
        return hierarchy.mode(compressor, setting, self.process_set.size() == runtime.size())

    def host_levels(self) -> HostLevels | None:
        """The per-host path's levels where a compressor of the policy may take it (a
        collective over every rank of the job where it registers their sets: hierarchy.py)."""
        setting = runtime.config().compression_hierarchy
        whole = self.process_set.size() == runtime.size()
        levels = {hierarchy.mode(c, setting, whole) for c in self.policy.compressors().values()}
        if levels <= {hierarchy.FLAT}:
            return None
        return hierarchy.engine_levels(self.process_set, runtime.config().sparse_algorithm)

    def reduces_here(self) -> bool:
        """Whether this rank reduces at all (module docstring, 6.): as in Horovod, ranks outside
        the process set do not (their gradients stay local), nor does a set of one rank, unless
        COMMLAYER_FORCE_FULL_PATH says to; synchronize() then returns at once."""
        alone = self.process_set.size() == 1 and not runtime.config().force_full_path
        return self.process_set.included() and not alone

    # -- groups= ---------------------------------------------------------------------------------
    def set_groups(self, groups: Groups) -> None:
        """Horovod's ``groups``: buckets fixed from the start (comm/bucketer.py, 3.), of the
        parameters that require grad. An int splits them, in rank 0's order of the optimizer's
        parameters (a collective, as Horovod's), into that many consecutive groups; lists name
        each group's parameters."""
        if groups is None:
            return
        if isinstance(groups, bool) or not isinstance(groups, (int, list, tuple)):
            raise ValueError(
                f"groups must be a positive int or a list of lists of parameters, got {groups!r}"
            )
        if isinstance(groups, int):
            if groups < 1:
                raise ValueError(
                    f"groups must be a positive int (how many groups to split the parameters "
                    f"into) or a list of lists of parameters, got {groups}"
                )
            lists = split_groups(self.root_order(), groups)
        else:
            checked = bucket_plan.checked_groups(groups, self.names)
            lists = [[p for p in group if p.requires_grad] for group in checked]
        compressor_of = {p: self.choose(p) for members in lists for p in members}
        fixed = [
            bucket_plan.bucket(members, compressor_of, self.names, self.per_host)
            for members in lists
            if members
        ]
        self.bucketer = Bucketer(self.bucketer.bucket_bytes, fixed)
        bucket_plan.assign_leaders(self.levels, fixed)

    def root_order(self) -> list[Param]:
        """The parameters that require grad, in the order of the optimizer's on the process
        set's first rank (every rank alike: a collective where this rank reduces)."""
        hooked = [p for p in self.params() if p.requires_grad]
        if not self.reduces or not hooked:
            return hooked
        from commlayer import state_sync  # imports the ops layer, as this module does

        order = state_sync.broadcast_object(
            [self.names[p] for p in hooked],
            min(self.process_set.ranks or [0]),
            name=f"{next(iter(self.names.values()))}.groups",
            process_set=self.process_set,
        )
        position = {name: i for i, name in enumerate(order)}
        differ = [self.names[p] for p in hooked if self.names[p] not in position]
        if differ or len(order) != len(hooked):
            raise ValueError(
                f"rank {runtime.rank()}: groups=int: the parameters that require grad differ "
                f"from the first rank's (here, not there: {differ[:10]}); every rank must wrap "
                "the same parameters"
            )
        return sorted(hooked, key=lambda p: position[self.names[p]])

    def choose(self, p: Param) -> CompressorBase:
        return self.policy.choose(self.names[p].removeprefix("grad."), p)

    def per_host(self, compressor: CompressorBase) -> bool:
        """Whether buckets of ``compressor`` are compressed once per host (its level)."""
        return self.level(compressor) == hierarchy.HOST

    # -- backward side ---------------------------------------------------------------------------
    def hook(self, params: list[Param]) -> None:
        """Submit each parameter's gradient as soon as backward has accumulated it."""
        if not self.reduces:
            return
        self.hooks += [
            p.register_post_accumulate_grad_hook(self.on_grad_ready)
            for p in params
            if p.requires_grad
        ]

    def on_grad_ready(self, p: Param) -> None:
        passes = self.passes.get(p, 0) + 1
        if passes > self.passes_per_step:
            raise RuntimeError(
                f"gradient of {self.names[p]!r} was computed again before step(): call "
                "optimizer.step() (or synchronize()) after every backward pass, or set "
                "backward_passes_per_step"
            )
        self.synchronized = self.user_synchronized = False
        self.passes[p] = passes
        if passes < self.passes_per_step:
            return
        self.ready += 1
        send = self.bucketer.ready(p)
        if isinstance(send, Bucket):
            self.send_bucket(send)
        elif send:
            self.send(send)
        if self.ready == len(self.hooks):
            # the step's last gradient: no company is coming, send now rather than at
            # step() (one negotiation round later, ~5% of an MLP step at 4 ranks)
            self.send(self.bucketer.take_unsent())

    def send(self, params: list[Param]) -> None:
        """Submit gradients outside buckets together (the engine negotiates and fuses what
        arrives together), instead of one collective per small gradient."""
        if not params:
            return
        with batch():
            for p in params:
                self.submit(p)

    def submit(self, p: Param) -> None:
        grad = p.grad
        if grad is None:
            grad = p.grad = self.empty_grad(p)
        if grad.is_sparse:
            if not self.sparse_as_dense:
                # One operation under the gradient's own name: a rank that has no gradient and
                # never saw it sparse submits a dense allreduce of that name, which negotiation
                # reports as a mismatch on every rank instead of a hang.
                self.sparse_dims[p] = grad.sparse_dim()
                handle = ops.sparse_allreduce_async(
                    grad, name=self.names[p], op=self.op, process_set=self.process_set
                )
                self.handles[p] = (handle, True)
                return
            grad = p.grad = grad.to_dense()
            self.resparsify.add(p)
        compressor = self.choose(p)
        per_host = self.level(compressor) == hierarchy.HOST
        reduced = self.comm.reduce([grad], compressor, self.names[p], None, per_host)
        self.handles[p] = (reduced, False)

    def send_bucket(self, bucket: Bucket) -> None:
        """The bucket's gradients reduced together (the communicator: one grouped allreduce a
        part uncompressed, one collective a round compressed), in place. A part that owns its
        memory (comm/bucketer.py, 4.) travels as its one flat buffer, the gradients' views
        made current first (``Part.gather``). At synchronize a member whose gradient backward
        did not produce contributes its ``grad`` (``empty_grad`` if None, as ``submit`` does:
        zeros, a bucketed gradient is never known-sparse), or, if it no longer requires grad,
        zeros that go nowhere: every rank sends the same bucket."""
        sends: list[tuple[list[torch.Tensor], list[str] | None]] = []  # tensors, names a part
        laned: dict[int, Future] = {}  # a part's position in the bucket: its lane's future
        for position, part in enumerate(bucket.parts):
            index = self.lane_index.get(part.name)
            if index is not None and part.flat is not None and self.lane is not None:
                laned[position] = self.send_planned(part, index, self.lane)
                sends.append(([], None))
                continue
            if part.flat is not None:
                taken = part.gather()
                if taken is not None:
                    self.resparsify.update(taken)
                    sends.append(([part.flat], None))
                    continue
            grads = []
            for p in part.params:
                grad = p.grad
                if grad is None or not p.requires_grad:
                    grad = self.empty_grad(p)
                    if p.requires_grad:
                        p.grad = grad
                elif grad.is_sparse:  # sparse now, dense in the recorded step: reduce it dense
                    grad = p.grad = grad.to_dense()
                    self.resparsify.add(p)
                grads.append(grad)
            sends.append((grads, [self.names[p] for p in part.params]))
        with batch():  # a group's parts: submitted together
            bucket.handles = [
                laned[i]
                if i in laned
                else self.comm.reduce(tensors, part.compressor, part.name, names, part.per_host)
                for i, (part, (tensors, names)) in enumerate(zip(bucket.parts, sends))
            ]

    def send_planned(self, part: bucket_plan.Part, index: int, lane: int) -> Future:
        """A part on the plan's lane (core/planned.py): its flat buffer, tail included, in plan
        order without negotiation. A part that no longer fits its memory (``gather`` None) is
        still posted, marked, so that every rank's lane stays in step and every rank fails it
        with an error naming this one."""
        assert part.flat is not None
        taken = part.gather()
        if taken is not None:
            self.resparsify.update(taken)
        op, prescale, postscale = self.comm.scaling(part.flat.dtype)
        flat = part.flat
        step = self.lane_steps[index]
        if taken is None:  # not as planned: what changed, for every rank's error
            dtype = next(
                (q.dtype for q, v in zip(part.params, part.views) if q.dtype != v.dtype), None
            )  # None: a shape or device changed
            step = planned.changed_code(dtype)
        self.lane_steps[index] += 1
        return submit(
            Request(
                ALLREDUCE, part.name, [flat], [flat], self.process_set, op=op,
                prescale=prescale, postscale=postscale, planned=(lane, index, step),
            )
        )  # fmt: skip

    def on_lane(self, bucket: Bucket) -> bool:
        """Whether a part of ``bucket`` travels on the plan's lane: then it is sent every step
        (its lane position must be taken on every rank), even where no member requires grad."""
        return self.lane is not None and any(p.name in self.lane_index for p in bucket.parts)

    def empty_grad(self, p: Param) -> torch.Tensor:
        """What a rank without a gradient for ``p`` contributes: no rows of a known-sparse
        gradient, else zeros."""
        sparse_dim = self.sparse_dims.get(p)
        if sparse_dim is None or self.sparse_as_dense:
            return torch.zeros_like(p)
        indices = torch.empty((sparse_dim, 0), dtype=torch.int64)
        values = torch.empty((0, *p.shape[sparse_dim:]), dtype=p.dtype)
        return torch.sparse_coo_tensor(indices, values, p.shape, check_invariants=False)  # empty

    # -- step side ---------------------------------------------------------------------------------
    def new_world(self) -> None:
        """Elastic training re-formed the world (commlayer/elastic): what was in flight is
        gone, the buckets are planned again from the next step's order (as a new worker plans
        its own: every rank alike), and whether this rank reduces follows the new size: the
        hooks come off over one rank (module docstring, 6.) and back on when the world grows."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
        self.reduces = self.reduces_here()
        self.levels = self.comm.levels = None  # their process sets belonged to the world gone
        self.lane, self.lane_index = None, {}  # the plan's lane belonged to the world gone too
        self.handles.clear()
        self.passes.clear()
        self.ready = 0
        self.synchronized = self.user_synchronized = False
        self.bucketer.restart()
        self.release_window()
        self.resparsify.clear()
        self.hook(self.params())

    def synchronize(self) -> None:
        if not self.reduces:
            self.synchronized = True
            return
        self.send(self.bucketer.take_unsent())
        late = []  # gradients backward did not produce: submitted now, zeros if None
        with batch():
            for p in self.params():
                if p.requires_grad and p not in self.handles and p not in self.bucketer.bucket_of:
                    self.submit(p)
                    late.append(p)
            for bucket in self.bucketer.buckets:
                # A bucket of parameters that all stopped requiring grad stays home, as a
                # frozen parameter does on the path one by one.
                if not bucket.handles and (
                    any(p.requires_grad for p in bucket.params) or self.on_lane(bucket)
                ):
                    self.send_bucket(bucket)
        start = time.perf_counter()
        failure = self.wait()
        self.wait_s += time.perf_counter() - start
        for p in self.resparsify:
            if p.grad is not None and not p.grad.is_sparse:
                p.grad = p.grad.to_sparse()
        self.resparsify.clear()
        self.handles.clear()
        self.passes.clear()
        self.ready = 0
        order = self.bucketer.step_done(failed=failure is not None)
        if failure is not None:
            raise failure
        if order is not None:
            self.plan_buckets(order, late)
        self.synchronized = True

    def wait(self) -> CommlayerError | None:
        """Wait for every reduction in flight (dense results are written in place, sparse sums
        replace ``p.grad``); returns the first error. Every future is waited for even after one
        failed, so that none is left in flight (its name would be a duplicate at the next step)
        and the error is raised once. A bucket's operation name (``grad.bucket[first..last]``)
        names its first and last gradients."""
        failure = None
        for bucket in self.bucketer.buckets:
            for handle in bucket.handles:
                try:
                    handle.wait()
                except CommlayerError as exc:
                    failure = failure or exc
        for p, (future, sparse) in self.handles.items():
            try:
                result = future.wait()
                if sparse:
                    p.grad = result
            except CommlayerError as exc:
                failure = failure or _with_hint(exc, self.names[p])
        return failure

    def plan_buckets(self, ready: list[Param], late: list[Param]) -> None:
        """After the first complete step (on every rank alike: a collective): the Bucketer's
        plan (comm/bucketer.py ``plan_buckets``) from the process set's first rank's ready
        order; sparse gradients stay on their own path."""
        from commlayer import state_sync  # imports the ops layer, as this module does

        root = min(self.process_set.ranks or [0])  # the set's first rank (a global rank)
        prefix = next(iter(self.names.values()))
        cfg = runtime.config()
        # lanes carry buckets in process memory: not where the window holds them
        skip = (
            cfg.planned_skip_negotiation
            and not cfg.window_buckets
            and self.op in (ReduceOp.Average, ReduceOp.Sum)
        )
        tail = planned.tail_numel(self.process_set.size()) if skip else 0
        buckets = bucket_plan.plan_buckets(
            [p for p in ready if p not in self.sparse_dims],
            [p for p in late if p not in self.sparse_dims],
            self.names,
            self.bucketer.bucket_bytes,
            self.choose,
            self.per_host,
            self.auto,
            lambda: self.auto.measure_links(self.comm.transport, self.levels, prefix),
            lambda plan: state_sync.broadcast_object(
                plan, root, name=f"{prefix}.bucket_plan", process_set=self.process_set
            ),
            root,
            runtime.rank(),
            tail,
        )
        self.release_window()
        if cfg.window_buckets:
            self.window = bucket_plan.house_in_window(
                buckets,
                lambda nbytes: bucket_window(
                    nbytes, f"{prefix}.bucket_window", self.process_set
                ).wait(),
            )
            if self.window is not None and runtime.rank() == root:
                housed = [
                    p for b in buckets for p in b.parts
                    if p.flat is not None and self.window.offset_of(p.flat) is not None
                ]  # fmt: skip
                _log.info(
                    "commlayer: DistributedOptimizer's %d bucket parts (%.1f MiB a rank) in a "
                    "shared-memory window of %d ranks (COMMLAYER_WINDOW_BUCKETS)",
                    len(housed),
                    self.window.memory.numel() / 2**20,
                    self.window.size,
                )
        self.bucketer.install(buckets)
        bucket_plan.assign_leaders(self.levels, buckets)
        # the first rank's setting decided (the tails it shared): every rank opens it, or none
        self.open_lane(buckets, f"{prefix}.bucket_plan.lane")

    def open_lane(self, buckets: list[Bucket], name: str) -> None:
        """COMMLAYER_PLANNED_SKIP_NEGOTIATION: the parts with a tail (owned, in host memory, of
        a floating dtype) on a lane of their own (core/planned.py), opened by one negotiated
        operation on the process set (collective: every rank registers the same parts, or
        every rank gets the error naming what differs)."""
        parts = [part for b in buckets for part in b.parts if part.tail and part.flat is not None]
        self.lane, self.lane_index = None, {}
        if not parts:
            return
        spec = planned.LaneSpec(
            tuple((p.flat.numel() - p.tail, dtype_name(p.flat.dtype)) for p in parts),  # type: ignore[union-attr]
            int(self.op),
        )
        change = Registration(lane=spec)
        lane = submit(Request(REGISTER, name, [], [], self.process_set, registration=change))
        self.lane = int(lane.wait())
        self.lane_index = {part.name: index for index, part in enumerate(parts)}
        self.lane_steps = [0] * len(parts)

    def release_window(self) -> None:
        """Give up the buckets' window (a new plan, a re-formed world): the gradients that
        are views of it become copies, and its channel is no longer announced (the memory goes
        once nothing views it: backends/shm.py's BucketWindow.close)."""
        window, self.window = self.window, None
        if window is None:
            return
        for p in self.params():
            grad = p.grad
            if grad is not None and not grad.is_sparse and window.offset_of(grad) is not None:
                p.grad = grad.clone()
        window.close()


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the dynamic subclass (see ``DistributedOptimizer``): Horovod's
    (``step``, ``synchronize``, ``skip_synchronize``, ``zero_grad``, ``state_dict``, ...);
    everything else is the ``_Reducer`` in ``self._commlayer``."""

    _commlayer: _Reducer

    @property
    def _parameter_names(self) -> dict[Param, str]:
        """{parameter: name} (horovod.torch's attribute): the names of named_parameters, else
        'grad.<position>' names, the same on every rank."""
        return {p: name.removeprefix("grad.") for p, name in self._commlayer.names.items()}

    @property
    def synchronize_wait_s(self) -> float:
        """Seconds step()/synchronize() spent blocked on reductions (settable: a benchmark
        sets 0.0 after its warm-up)."""
        return self._commlayer.wait_s

    @synchronize_wait_s.setter
    def synchronize_wait_s(self, seconds: float) -> None:
        self._commlayer.wait_s = seconds

    def compression_decisions(self) -> list[dict[str, Any]]:
        """What ``compression="auto"`` chose, one entry per bucket class (rank 0's decisions,
        kept on rank 0; empty before the second step and without auto): the choice, the
        bucket's bytes and tensors, the predicted seconds and measured CPU seconds of each
        candidate, and the link it was decided for; then, as ``kind`` "compression
        hierarchy", COMMLAYER_COMPRESSION_HIERARCHY=auto's for compressors given outright (a
        choice ``<name>@host``: compressed once per host)."""
        reducer = self._commlayer
        auto = reducer.auto
        return [d for c in auto.autos() for d in c.decisions] + auto.hierarchy_decisions

    def synchronize(self) -> None:
        """Wait for every gradient's reduction and write the results into ``p.grad``. Then
        call ``step()`` inside ``skip_synchronize()`` (as in Horovod; without it, step()
        warns)."""
        self._commlayer.synchronize()
        self._commlayer.user_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``with opt.skip_synchronize(): opt.step()`` after an explicit ``synchronize()``."""
        self._commlayer.should_synchronize = False
        try:
            yield
        finally:
            self._commlayer.should_synchronize = True

    def step(self, closure: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        reducer = self._commlayer
        if reducer.should_synchronize:
            if reducer.user_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(): use `with optimizer.skip_synchronize(): "
                    "optimizer.step()` after an explicit synchronize() (commlayer does not "
                    "reduce twice, Horovod would)",
                    stacklevel=2,
                )
            if not reducer.synchronized:
                reducer.synchronize()
        reducer.synchronized = reducer.user_synchronized = False
        self._opt_called = True  # what an LR scheduler's patch of step notes (DistributedOptimizer)
        # super(self.__class__, ...): these methods are copied onto a class made with type(), so
        # zero-argument super() would name _DistributedOptimizer, which self is not.
        parent: Any = super(self.__class__, self)
        return parent.step(closure, **kwargs) if closure is not None or kwargs else parent.step()

    def _commlayer_param_groups(self) -> list[dict[str, Any]]:
        # Whoever reads the gradients through the optimizer (GradScaler.unscale_ and its inf
        # check, clipping helpers) must see reduced ones: finish the reductions first.
        reducer = self.__dict__.get("_commlayer")
        if reducer is not None and reducer.ready:
            reducer.synchronize()
        return self.__dict__["param_groups"]  # type: ignore[no-any-return]

    def _commlayer_set_param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.__dict__["param_groups"] = groups

    param_groups = property(_commlayer_param_groups, _commlayer_set_param_groups)  # type: ignore[assignment]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A group added after wrapping (a layer unfrozen for fine-tuning) is named and hooked
        like the others; without a name its gradient could not be reduced."""
        reducer = self._commlayer
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        names = _parameter_names(params, reducer.named, first_index=len(reducer.names))
        param_group["params"] = params
        super(self.__class__, self).add_param_group(param_group)
        reducer.names.update(names)
        reducer.hook(params)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, plus this rank's compressor state (error-feedback
        residuals differ per rank: each rank saves its own to restart exactly)."""
        state: dict[str, Any] = super(self.__class__, self).state_dict()
        compression = self._commlayer.policy.state_dict()
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
            self._commlayer.policy.load_state_dict(saved["compressors"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._commlayer.ready:
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
    groups: Groups = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so ``step()`` applies gradients averaged (``op``) across ranks.

    ``groups`` (Horovod's): an int splits the parameters that require grad, in the optimizer's
    order, into that many consecutive groups; a list of lists of parameters names them. Each
    group's gradients are reduced together, one grouped allreduce per dtype, once all of them
    are ready (parameters in no group are bucketed as usual: comm/bucketer.py).
    ``compression``: ``Compression.fp16``, a spec (``"topk:ratio=0.01"``), a
    ``compression.Policy`` for per-parameter choices, or None for ``COMMLAYER_COMPRESSION``
    (default ``none``).
    """
    op = ReduceOp(op)
    _check_arguments(backward_passes_per_step, gradient_predivide_factor, op, process_set)
    runtime.hint_alone("DistributedOptimizer")  # `python train.py`: say how to start N ranks
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
    reducer = _Reducer(
        wrapped.__dict__,
        _name_map(named_parameters),
        _policy(compression),
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        sparse_as_dense,
        process_set,
    )
    reducer.set_groups(groups)
    wrapped.__dict__["_commlayer"] = reducer
    reducer.hook(reducer.params())
    _reducers.add(reducer)
    return wrapped  # type: ignore[no-any-return]


# Every DistributedOptimizer's reducer (weakly): an elastic re-formation restarts them all,
# also those the training state does not hold.
_reducers: weakref.WeakSet[_Reducer] = weakref.WeakSet()


def new_world() -> None:
    """The world was re-formed (commlayer.elastic): every DistributedOptimizer drops what it
    had in flight and starts over at the new size (``_Reducer.new_world``)."""
    for reducer in list(_reducers):
        reducer.new_world()


def _check_arguments(
    backward_passes_per_step: int,
    gradient_predivide_factor: float,
    op: ReduceOp,
    process_set: ProcessSet,
) -> None:
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if gradient_predivide_factor != 1.0 and op != ReduceOp.Average:
        raise ValueError("gradient_predivide_factor needs op=Average")
    # Over one rank the wrapper is the identity (module docstring, 6.), whatever the op
    # (Horovod's too: at size 1 it wraps even op=Adasum in its plain optimizer).
    alone = process_set.size() == 1 and not runtime.config().force_full_path
    if op == ReduceOp.Adasum and not alone:
        raise ValueError(
            f"rank {runtime.rank()}: DistributedOptimizer(op=Adasum) is not supported: "
            "Horovod applies Adasum to each "
            "step's parameter change in an optimizer of its own; use op=Average or op=Sum, "
            "or commlayer.allreduce(tensor, op=Adasum) on what you want combined"
        )


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
    lossy = [c.name for c in policy.compressors().values() if not c.compresses_small_tensors]
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
