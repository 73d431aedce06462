"""Runtime: init/shutdown of the process-wide engine, and the rank topology queries.

A rank that fails ends the whole job, never leaving its peers blocked (issue 38): ``init()``
chains a ``sys.excepthook`` so that an exception nobody caught, on any rank of a job of more
than one, ends the job as ``python -m mpi4py`` does. Under MPI the rank aborts the job
(MPI_Abort, after its other exit handlers, instead of MPI_Finalize: MPICH's waits for every
rank, for ever where one waits on this rank); under torch.distributed it exits at once
(``shutdown()`` gives its goodbye 3 s), its peers in collectives get an error naming it, and
torchrun's agent stops the others. A normal ``shutdown()`` waits for the goodbye past the
collective watchdog, which aborts the job when a peer never answers.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from commlayer import backends, kernels
from commlayer.backends import shm
from commlayer.backends.base import Backend
from commlayer.common import config as config_module
from commlayer.common.config import Config
from commlayer.common.errors import ConfigError, NotInitializedError
from commlayer.core import malloc
from commlayer.core import process_sets as process_sets_module
from commlayer.core.engine import Engine
from commlayer.core.process_sets import ProcessSet, check_ranks, global_process_set
from commlayer.core.registries import REGISTRIES

# config.load() and config.override() called without registries (tests, tools) check names
# against the same registries as init().
config_module.install_registries(REGISTRIES)

log = logging.getLogger("commlayer")

_lock = threading.Lock()
_engine: Engine | None = None
_backend_name = ""  # the registered backend the running engine's messages travel over
_backend_module: backends.Lifecycle | None = None  # its module: end_job, finish
_launched_by = ""  # config.launch()'s launcher ("mpi", "torchrun"), "elastic", "" for none
_aborts_at_exit = False  # its end_job: the job aborts at this process's exit
_config: Config | None = None  # what init() resolved: every consumer reads this one
_topology: dict[str, int] = {}
_summary = ""  # startup_summary(): what init() started, one line
_atexit_registered = False
# Set by the excepthook: this process exits on an exception nobody caught (module docstring).
_failing = False
# shutdown()'s wait for the other ranks to take its goodbye, when this rank fails: a courtesy
# (a peer blocked in a collective gets ShutdownError naming this rank at once, else
# RankDiedError within a second of this process's exit), not worth holding the job for.
_FAILING_GOODBYE_S = 3.0
# ... otherwise: past the collective watchdog, which ends a goodbye nobody answers (the job
# aborts, naming the ranks it waits on), or this long where the watchdog is off.
_WATCHDOG_MARGIN_S = 5.0
_NO_WATCHDOG_GOODBYE_S = 30.0
_NOT_INITIALIZED = (
    "commlayer has not been initialized; call commlayer.init() first (or it was shut down)"
)


def init(
    comm: Any = None, process_sets: Sequence[ProcessSet] | None = None, **settings: Any
) -> None:
    """Start commlayer on this process (under ``mpiexec -n N`` or as a plain 1-rank run).

    ``comm``: an mpi4py communicator or a list of global ranks to run on (default: all).
    ``process_sets``: ProcessSet objects to register (collective: same list on every rank).
    ``settings``: explicit Config fields, which win over COMMLAYER_* variables.
    Calling init again while running does nothing.

    The environment is read here, once: the resolved Config goes to the engine, is handed
    down to the kernels (``kernels.use``) and is ``config()`` for the layers above.
    """
    global _user_init
    with _lock:
        if _engine is not None and _engine.running:
            return
        _user_init = (comm, list(process_sets or ()), dict(settings))
        _added_sets.clear()
    _start(comm, list(process_sets or ()), settings, reformed=False)


# What the user's last init() was given (``restart()`` starts commlayer again with it), and the
# process sets add_process_set registered since, less those removed (``added_process_sets``).
_user_init: tuple[Any, list[ProcessSet], dict[str, Any]] = (None, [], {})
_added_sets: list[ProcessSet] = []


def restart() -> None:
    """Start commlayer again after shutdown() as the user's last init() did: its keyword
    settings, its ``comm`` and its process sets (registered again: new ids). The elastic
    driver's re-formed world (``elastic.run``) starts so. A process set with a rank the new
    world does not have is a ValueError naming it and the world's size, on every rank."""
    comm, sets, settings = _user_init
    _start(comm, sets, settings, reformed=True)


def remember_process_set(ps: ProcessSet, added: bool) -> None:
    """``add_process_set`` registered ``ps`` (``added``), or ``remove_process_set`` removed it."""
    with _lock:
        _added_sets[:] = [p for p in _added_sets if p is not ps] + ([ps] if added else [])


def added_process_sets() -> list[ProcessSet]:
    """The process sets add_process_set registered since init(), in order, less those
    removed."""
    with _lock:
        return list(_added_sets)


def _start(
    comm: Any, process_sets: Sequence[ProcessSet], settings: dict[str, Any], reformed: bool
) -> None:
    global _engine, _config, _atexit_registered, _summary
    with _lock:
        if _engine is not None and _engine.running:
            return
        cfg = config_module.load(registries=REGISTRIES, **settings)
        _configure_logging(cfg.log_level)
        kernels.use(cfg.kernels, cuda_ptx_dir=cfg.cuda_ptx_dir)
        # debug, not info: every rank says it, and info (the default) is rank 0's one line
        log.debug(
            "malloc: %s", malloc.tune(cfg.malloc_tuning, config_module.glibc_malloc_variables())
        )
        if cfg.line_output:
            _line_buffered()
        backend, engine = _start_engine(comm, cfg, process_sets, reformed)
        _engine, _config = engine, cfg
        process_sets_module.bind((backend.rank, backend.size))
        _summary = summary_line(backend.nodes(), backend.hosts(), _backend_name, cfg)
        if backend.rank == 0:
            log.info("%s", _summary)
        # Move every object alive now (torch's, the model's) out of the cyclic GC's reach: a
        # full collection walks them all and paused the engine ~100 ms every few thousand
        # operations (measured: 100 async allreduces took 8-100 ms before, 3-6 ms after).
        gc.freeze()
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True


def _start_engine(
    comm: Any, cfg: Config, process_sets: Sequence[ProcessSet], reformed: bool
) -> tuple[Backend, Engine]:
    """The backend and the engine, started; an elastic driver's worker starts over in its next
    world when a worker of this one dies meanwhile (their set-up is collective: it would fail,
    or wait for the dead worker)."""
    while True:
        try:
            backend = _start_backend_once_prefixed(comm, cfg)
            engine = Engine(backend, cfg)
            _topology.clear()
            _topology.update(_derive_topology(backend.rank, backend.nodes()))
            for ps in process_sets:
                if reformed and any(r >= backend.size for r in ps.ranks):
                    raise ValueError(
                        f"commlayer rank {backend.rank}: the world re-formed at size "
                        f"{backend.size}, and process set {ps.ranks} of init(process_sets=...) "
                        "has ranks it does not have: give init() only sets that every size the "
                        "job may have (--min-np) contains, and add the others with "
                        "add_process_set when the size allows"
                    )
                check_ranks(ps, backend.size)
                ps.process_set_id, _ = engine.register_process_set(ps.ranks)
            engine.start()
        except Exception as exc:
            if not _elastic_world_broken():
                raise
            log.warning("commlayer: the world broke while commlayer started (%s); again", exc)
            if _backend_module is not None:
                _backend_module.finish(True, True)
            continue
        return backend, engine


@dataclasses.dataclass(frozen=True)
class ElasticRendezvous:
    """How an elastic driver's worker joins its world (commlayer/elastic/rendezvous.py, which
    registers it with ``use_elastic_rendezvous``: the API layer's elastic package, which the
    core does not import): ``join(timeout_s)`` starts torch.distributed over the next world;
    ``broken()``, whether a worker of the current one died."""

    join: Callable[[float], None]
    broken: Callable[[], bool]


_elastic_rendezvous: ElasticRendezvous | None = None


def use_elastic_rendezvous(rendezvous: ElasticRendezvous) -> None:
    """The elastic worker's rendezvous (``import commlayer`` registers it)."""
    global _elastic_rendezvous
    _elastic_rendezvous = rendezvous


def _elastic_world_broken() -> bool:
    """Whether this is an elastic driver's worker whose world lost a worker."""
    if config_module.elastic_worker() is None or _elastic_rendezvous is None:
        return False
    return _elastic_rendezvous.broken()


# sys.excepthook: ``_excepthook`` prints the traceback with ``_hook_below`` (Python's, or the
# user's, and torch's once it started: it puts ``[rankN]:`` before each line), then ends the
# job. ``_hook_base`` is what was in place before the backend started, so that a backend
# started again (shutdown() and init(), an elastic world re-formed) wraps that, not the last
# start's wrapper: torch's init_process_group wraps whatever hook it finds, and every
# re-formed generation added one more ``[rankN]:`` to each line of a traceback.
_hook_base: Any = None
_hook_below: Any = None


def _excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    """The traceback as before (``_hook_below``), then ``_end_job``."""
    try:
        _hook_below(kind, exc, tb)
    finally:
        _end_job(exc)


def _start_backend_once_prefixed(comm: Any, cfg: Config) -> Backend:
    """``_start_backend``, with sys.excepthook left as ``_excepthook`` over one prefix of the
    backend started now (the comment above ``_hook_base``). A hook someone else put on top of
    ours since is left alone."""
    global _hook_base, _hook_below
    ours_on_top = sys.excepthook is _excepthook
    if ours_on_top:
        sys.excepthook = _hook_base
    else:
        _hook_base = sys.excepthook
    try:
        backend = _start_backend(comm, cfg)
    finally:
        if ours_on_top or _hook_below is None:
            _hook_below, sys.excepthook = sys.excepthook, _excepthook
    return backend


def _end_job(exc: BaseException) -> None:
    """This rank raised ``exc`` and nobody caught it: make it end the whole job, saying so
    (module docstring). Also after shutdown(): MPI_Finalize would still wait for the peers."""
    global _failing, _aborts_at_exit
    if _topology.get("size", 1) < 2 or _backend_module is None:
        return
    _failing = True
    what = f"rank {_topology['rank']} raised an uncaught {type(exc).__name__}: {exc}"
    _aborts_at_exit = _backend_module.end_job(what, exc)
    sys.stderr.flush()


def _start_backend(comm: Any, cfg: Config) -> Backend:
    """The backend ``cfg.backend`` names (auto: backends.auto), over ``comm`` (a communicator
    or process group, or a list of global ranks); ConfigError before its library starts where
    it cannot run (backends.choose)."""
    global _backend_name, _backend_module, _launched_by
    launch = config_module.launch()
    elastic = config_module.elastic_worker() is not None and not backends.registry.ready()
    _launched_by = launch.launcher or ("elastic" if elastic else "")
    chosen = backends.choose(cfg.backend, launch, elastic)
    join = None
    if elastic:
        if _elastic_rendezvous is None:  # commlayer/__init__ imports elastic, which registers
            raise ConfigError(
                "started by commlayerrun's elastic driver, but commlayer.elastic is not "
                "imported: import commlayer (or commlayer.elastic) before init()"
            )
        join = _elastic_rendezvous.join  # this generation's world
    module = chosen.load()
    # before start: a start that fails midway (an elastic world that broke in new_group) is
    # finished through it, as _start_engine does
    _backend_name, _backend_module = chosen.name, module
    return module.start(comm, cfg, launch, join)


def _ranges(ranks: Sequence[int]) -> str:
    """'0-3' for [0, 1, 2, 3], '0,2' for [0, 2], '0-1,4' for [0, 1, 4]."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}-{prev}" if prev > start else f"{start}")
        if r is not None:
            start = prev = r
    return ",".join(parts)


def summary_line(
    nodes: Sequence[int], hosts: Sequence[str], backend: str, cfg: Config, most_hosts: int = 8
) -> str:
    """One line saying what a job got: ranks, nodes and their hosts with the ranks on each (the
    first ``most_hosts``), the topology, the backend and the settings that shape communication
    (``startup_summary()``; rank 0 logs it at info level from ``init()``)."""
    size = len(nodes)
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    per_node = sorted({len(ranks) for ranks in by_node.values()})
    shape = (
        f"{per_node[0]} rank{'s' if per_node[0] != 1 else ''} per node"
        if len(per_node) == 1
        else f"{per_node[0]}-{per_node[-1]} ranks per node"
    )
    places = [f"{hosts[ranks[0]]}: {_ranges(ranks)}" for ranks in by_node.values()]
    if len(places) > most_hosts:
        places = [*places[:most_hosts], f"... {len(places) - most_hosts} more"]
    topology = f", topology {cfg.topology}" if cfg.topology else ""
    return (
        f"commlayer started: {size} rank{'s' if size != 1 else ''} on {len(by_node)} "
        f"node{'s' if len(by_node) != 1 else ''} ({shape}; {'; '.join(places)}){topology}, "
        f"backend {backend}, allreduce algorithm {cfg.allreduce_algorithm}, compression "
        f"{cfg.compression}, fusion {_fusion(cfg.fusion_threshold_bytes)}, wait policy "
        f"{cfg.wait_policy}"
    )


def _fusion(threshold_bytes: int) -> str:
    """'64 MiB' as COMMLAYER_FUSION_THRESHOLD is written, 'off' for 0."""
    for shift, suffix in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if threshold_bytes and threshold_bytes % (1 << shift) == 0:
            return f"{threshold_bytes >> shift} {suffix}"
    return f"{threshold_bytes} B" if threshold_bytes else "off"


def startup_summary() -> str:
    """What ``init()`` started, in one line: ranks, nodes and hosts (with the ranks on each),
    backend, allreduce algorithm, compression, fusion threshold, wait policy. Rank 0 logs it
    at info level, the default (``COMMLAYER_LOG_LEVEL=warning`` leaves it out).
    NotInitializedError before ``init()``."""
    engine()
    return _summary


_hinted_alone = False


def hint_alone(what: str) -> None:
    """Log once, at info level, that ``what`` (``DistributedOptimizer``) runs over one rank
    because no launcher started this process, and how to start several: a script run as
    ``python train.py`` trains alone, correctly and silently, which a user who meant to run it
    on N processes cannot tell from a working job. Nothing under any launcher (``mpiexec -n
    1`` is one rank on purpose) or in an elastic worker."""
    global _hinted_alone
    if _hinted_alone or size() != 1 or _launched_by:
        return
    _hinted_alone = True
    script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else "train.py"
    log.info(
        "commlayer: %s runs over 1 rank: no launcher started this process, so there is no "
        "other rank to average with and it is the plain optimizer. To train on N processes: "
        "commlayerrun -np N python %s (or torchrun --nproc_per_node N %s)",
        what,
        script,
        script,
    )


def backend_name() -> str:
    """What the running engine's messages travel over: the registered backend's name ("mpi",
    "torch" for torch.distributed, "loopback"); "" before init()."""
    return _backend_name if _engine is not None else ""


def _line_buffered() -> None:
    """COMMLAYER_LINE_OUTPUT=on: a whole line per write on stdout and stderr (the launcher's
    rank prefix goes before each write)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:  # a TextIOWrapper; replaced streams are left as they are
            stream.flush()
            reconfigure(line_buffering=True, write_through=False)


def _configure_logging(level: str) -> None:
    logger = logging.getLogger("commlayer")
    logger.setLevel(5 if level == "trace" else getattr(logging, level.upper()))
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s commlayer %(levelname)s] %(message)s"))
        logger.addHandler(handler)


def _derive_topology(rank: int, nodes: list[int]) -> dict[str, int]:
    local = [r for r, node in enumerate(nodes) if node == nodes[rank]]
    local_rank = local.index(rank)
    peers = [
        r
        for r, node in enumerate(nodes)
        if [q for q, n in enumerate(nodes) if n == node].index(r) == local_rank
    ]
    return {
        "rank": rank,
        "size": len(nodes),
        "local_rank": local_rank,
        "local_size": len(local),
        "cross_rank": peers.index(rank),
        "cross_size": len(peers),
    }


def shutdown() -> None:
    """Stop the engine (telling the other ranks); collectives fail afterwards until init()."""
    global _engine, _config
    with _lock:
        engine, _engine, _config = _engine, None, None
        process_sets_module.bind(None)
    if engine is None:
        return
    if _failing and _aborts_at_exit:
        return  # no goodbye: the job aborts at exit (_end_job)
    stopped = engine.shutdown(_goodbye_wait_s(engine.config))
    if _backend_module is not None:
        # requests a planned lane left in flight: as if not stopped (no MPI_Finalize)
        _backend_module.finish(stopped and not engine.abandoned_requests, engine.peer_died)


def _goodbye_wait_s(cfg: Config) -> float:
    """How long shutdown() waits for the other ranks to take its goodbye (module constants)."""
    if _failing:
        return _FAILING_GOODBYE_S
    if cfg.collective_timeout_s > 0:
        return cfg.collective_timeout_s + _WATCHDOG_MARGIN_S
    return _NO_WATCHDOG_GOODBYE_S


def engine() -> Engine:
    """The running engine; NotInitializedError if init() was not called."""
    current = _engine
    if current is None:
        raise NotInitializedError(_NOT_INITIALIZED)
    return current


def config() -> Config:
    """The Config that init() resolved (environment and init() arguments), with the settings
    of any active ``config.override()`` block (tests) on top; NotInitializedError before."""
    current = _config
    if current is None:
        raise NotInitializedError(_NOT_INITIALIZED)
    layer = config_module.overrides()
    return dataclasses.replace(current, **layer) if layer else current


def communication_stats() -> dict[str, float]:
    """Counters of this rank's engine since init: operations (collectives run, fused buckets
    counted once), payload_bytes reduced or moved, wire_bytes (estimate of bytes a bandwidth-
    optimal algorithm sends from this rank), collective_s (time inside collectives that
    ended), collective_now_s (the same, with the elapsed part of the one running now: the
    figure to take before and after a wait), cycles (negotiation cycles), engine_cpu_s (CPU
    seconds of the engine thread: take it before and after some steps for its CPU a step),
    window_copied_bytes (bytes this process copied into, out of and between shared-memory
    windows: memory traffic beside the wire, which buckets that live in a window cut)."""
    current = engine()
    return {
        **dataclasses.asdict(current.stats),
        "collective_now_s": current.collective_now_s(),
        "engine_cpu_s": current.cpu_s(),
        "window_copied_bytes": shm.copied_bytes() - current.copied_at_start,
    }


def is_initialized() -> bool:
    return _engine is not None


def _topo(key: str) -> int:
    engine()
    return _topology[key]


def rank() -> int:
    """This process's rank among all processes."""
    return _topo("rank")


def size() -> int:
    """Number of processes."""
    return _topo("size")


def local_rank() -> int:
    """Rank among the processes on this node (sharing memory)."""
    return _topo("local_rank")


def local_size() -> int:
    """Number of processes on this node."""
    return _topo("local_size")


def cross_rank() -> int:
    """Rank among the processes with this local rank, one per node."""
    return _topo("cross_rank")


def cross_size() -> int:
    """Number of processes with this local rank (the number of nodes, when uniform)."""
    return _topo("cross_size")


def is_homogeneous() -> bool:
    """Whether every node runs the same number of processes."""
    return size() == local_size() * cross_size()


__all__ = [
    "init",
    "shutdown",
    "config",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_initialized",
    "backend_name",
    "startup_summary",
    "global_process_set",
]
