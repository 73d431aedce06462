"""Configuration: every COMMLAYER_* environment variable is read here and nowhere else.

Each knob is declared once in ``_VARIABLES`` (environment name, field, Validator, help);
``load()`` parses the environment into a frozen :class:`Config`; a bad value raises
:class:`~commlayer.common.errors.ConfigError` naming the variable, the value and what is allowed.
Settings that name something another module owns (an algorithm, a compressor, the kernels, a
topology) are checked by the :class:`Validator` that module supplies, passed in as
``registries`` (commlayer.core.registries): config imports no commlayer module but errors, and holds
strings and numbers only. ``init()`` resolves the Config once (``runtime.config()``).
Explicit arguments win over the environment: ``load(fusion_threshold_bytes=0)``; tests use
``with override(cycle_time_ms=0.5): ...``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import re
import textwrap
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from commlayer.common.errors import ConfigError

_LOG_LEVELS = ("trace", "debug", "info", "warning", "error")
WAIT_POLICIES = ("auto", "active", "passive")
JOIN_MODES = ("horovod", "active")
# A boolean setting's words, any case (parse_bool): one vocabulary for every on/off setting.
TRUE_WORDS = ("1", "true", "on", "yes")
FALSE_WORDS = ("0", "false", "off", "no")
HIERARCHIES = ("auto", "flat", "host")


@dataclasses.dataclass(frozen=True)
class Config:
    """Engine settings; units are in the field names."""

    fusion_threshold_bytes: int = 64 * 1024 * 1024
    min_bucket_bytes: int = 1024 * 1024
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
    compression: str = "none"
    compression_hierarchy: str = "auto"
    timeline_path: str = ""
    stall_check_time_s: float = 60.0
    # 10 minutes, NCCL's watchdog default: above a slow rank's first step (torch.compile), a
    # checkpoint or an evaluation only rank 0 runs while the others wait in the next collective;
    # below a job burning its allocation on a rank that will never come (a hang by default
    # before: issue 38)
    stall_shutdown_time_s: float = 600.0
    log_level: str = "info"  # rank 0's one start-up line (runtime.summary_line)
    allreduce_algorithm: str = "auto"
    topology: str = ""
    sparse_algorithm: str = "allgather"
    kernels: str = "auto"
    cuda_ptx_dir: str = ""
    wait_policy: str = "auto"
    malloc_tuning: bool = True
    auto_tuning: bool = True
    join_mode: str = "horovod"
    init_timeout_s: float = 60.0
    collective_timeout_s: float = 60.0
    backend: str = "auto"
    cuda_aware_mpi: bool | None = None  # None: auto
    nccl: bool | None = None  # None: auto
    sim_table: str = ""
    force_full_path: bool = False
    window_buckets: bool = False
    line_output: bool = False
    planned_skip_negotiation: bool = False

    @property
    def idle_cycle_time_ms(self) -> float:
        """Heartbeat of a rank with nothing pending: only stall, join and shutdown news need it,
        and a rank that gets work posts at once, so it can be 100x longer than the cycle time.
        Each heartbeat is a negotiation, a meeting of every rank's engine thread: alone on a
        machine one costs little (idle engine CPU < 0.5% of a core at 20 ms), but while
        forward and backward keep every core busy one costs ~1 ms of engine CPU, and at 20 ms
        they were 20 of the 34 negotiations of a ResNet step (benchmarks/train.py)."""
        return max(100.0 * self.cycle_time_ms, 5.0)


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def _parse_bytes(text: str) -> int:
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError("a non-negative integer number of bytes, optionally with K/M/G suffix")
    unit = (match.group(2) or "").lower()[:1]
    return int(match.group(1)) * _SIZE_UNITS[unit]


# The most a cache holds (COMMLAYER_CACHE_CAPACITY): its slot and free lists are allocated
# whole at init(), ~48 bytes an entry per process set (200000000 would take 9.6 GB a rank).
# 2**20 is ~48 MiB, 1000x the default and above the tensors any model names (a 96-layer,
# 175B-parameter GPT has ~1200 parameter tensors).
MAX_CACHE_CAPACITY = 1 << 20
# The longest timeout any setting takes, in seconds: a week, longer than the jobs schedulers
# allow (Slurm sites cap them at 1-7 days), so a larger value only means "never", which 0 says
# where a timeout can be off; and far below where waiting breaks (threading.TIMEOUT_MAX, ~9.2e9
# s, and torch's timedelta: 1e308 failed inside torch or at exit).
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# The longest cycle time, in ms: a second, 1000x the default. A rank with work waits this long
# before negotiating, and the idle heartbeat (100 cycles) brings a peer's shutdown or stall
# news 100 s late already.
MAX_CYCLE_TIME_MS = 1000.0


def _parse_cache_capacity(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_CACHE_CAPACITY:
        raise ValueError(f"an integer from 0 to {MAX_CACHE_CAPACITY}")
    return value


def _number(text: str, zero: bool, most: float) -> float:
    value = float(text)
    if not (value >= 0 if zero else value > 0) or not value <= most:
        raise ValueError(text)  # nan fails both comparisons, inf the second
    return value


_TIMEOUT_RANGE = f"at most {MAX_TIMEOUT_S:.0f} (7 days)"


def check_timeout_s(what: str, value: float, zero_disables: bool = False) -> float:
    """``value`` when it is a timeout in seconds commlayer can wait (> 0, or >= 0 where 0
    turns it off, at most MAX_TIMEOUT_S); ConfigError naming ``what`` (a launcher option such
    as commlayerrun's ``--elastic-timeout``), the value and the allowed range otherwise."""
    try:
        return _number(str(value), zero_disables, MAX_TIMEOUT_S)
    except ValueError:
        least = ">= 0 (0 disables)" if zero_disables else "> 0"
        raise ConfigError(
            f"{what} {value!r} is not valid: expected a finite number of seconds {least}, "
            f"{_TIMEOUT_RANGE}"
        ) from None


def _parse_log_level(text: str) -> str:
    value = text.strip().lower()
    if value not in _LOG_LEVELS:
        raise ValueError(f"one of {', '.join(_LOG_LEVELS)}")
    return value


def parse_bool(text: str) -> bool:
    """A boolean setting's value: 1, true, on, yes or 0, false, off, no (any case, spaces
    ignored); ValueError otherwise."""
    value = text.strip().lower()
    if value in TRUE_WORDS or value in FALSE_WORDS:
        return value in TRUE_WORDS
    raise ValueError(value)


def parse_auto_bool(text: str) -> bool | None:
    """``auto`` (None: decided at run time) or a boolean (``parse_bool``)."""
    return None if text.strip().lower() == "auto" else parse_bool(text)


class InvalidValue(ValueError):
    """A parser's ValueError that says why (a file that cannot be read): the ConfigError
    quotes it; other ValueErrors only say what is allowed."""


def one_of(choices: Callable[[], Sequence[str]]) -> Callable[[str], str]:
    """A parser for one of a set of names (``choices()`` asked at each call, so names registered
    later count), case and surrounding spaces ignored."""

    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices():
            raise ValueError(value)
        return value

    return parse


@dataclasses.dataclass(frozen=True)
class Validator:
    """How one setting's text becomes its value: ``parse`` returns the value (ValueError when
    the text is not allowed), ``allowed()`` says what is allowed, for the error message."""

    parse: Callable[[str], Any]
    allowed: Callable[[], str]


def _fixed(parse: Callable[[str], Any], allowed: str) -> Validator:
    return Validator(parse, lambda: allowed)


_BYTES = _fixed(
    _parse_bytes, "a non-negative integer number of bytes, optionally with K/M/G suffix"
)
_CACHE_CAPACITY = _fixed(
    _parse_cache_capacity, f"an integer >= 0 and at most {MAX_CACHE_CAPACITY} (0 disables)"
)
_CYCLE_TIME = _fixed(
    lambda text: _number(text, False, MAX_CYCLE_TIME_MS),
    f"a finite number > 0, at most {MAX_CYCLE_TIME_MS:.0f}",
)
_TIMEOUT = _fixed(
    lambda text: _number(text, False, MAX_TIMEOUT_S), f"a finite number > 0, {_TIMEOUT_RANGE}"
)
_TIMEOUT_OR_OFF = _fixed(
    lambda text: _number(text, True, MAX_TIMEOUT_S),
    f"a finite number >= 0 (0 disables), {_TIMEOUT_RANGE}",
)
_LOG_LEVEL = _fixed(_parse_log_level, f"one of {', '.join(_LOG_LEVELS)}")
_WAIT_POLICY = _fixed(one_of(lambda: WAIT_POLICIES), f"one of {', '.join(WAIT_POLICIES)}")
_JOIN_MODE = _fixed(one_of(lambda: JOIN_MODES), f"one of {', '.join(JOIN_MODES)}")
_BOOLEAN = f"{', '.join(TRUE_WORDS)} or {', '.join(FALSE_WORDS)} (any case)"
_BOOL = _fixed(parse_bool, f"a boolean: {_BOOLEAN}")
_AUTO_BOOL = _fixed(parse_auto_bool, f"auto or a boolean: {_BOOLEAN}")
_HIERARCHY = _fixed(one_of(lambda: HIERARCHIES), f"one of {', '.join(HIERARCHIES)}")
_PATH = _fixed(str, "a path")
# In _VARIABLES: a setting whose allowed values are names other modules own (algorithms,
# compressors, ...); config imports none of them, their Validators are passed in.
_REGISTERED = None

# (environment variable, Config field, Validator or _REGISTERED, help)
_VARIABLES: tuple[tuple[str, str, Validator | None, str], ...] = (
    (
        "COMMLAYER_FUSION_THRESHOLD",
        "fusion_threshold_bytes",
        _BYTES,
        "largest fusion buffer in bytes (0 disables fusion); default 64 MiB",
    ),
    (
        "COMMLAYER_MIN_BUCKET_BYTES",
        "min_bucket_bytes",
        _BYTES,
        "DistributedOptimizer's bucket size: gradients are reduced in buckets of this many "
        "bytes, each sent when its last gradient is ready (the first step in backward's ready "
        "order, then fixed buckets in rank 0's order of that step, one dtype and compressor a "
        "bucket); 0 sends each gradient alone; default 1 MiB",
    ),
    (
        "COMMLAYER_CYCLE_TIME",
        "cycle_time_ms",
        _CYCLE_TIME,
        "longest wait, in ms, of a rank with pending work before the next negotiation; default 1",
    ),
    (
        "COMMLAYER_CACHE_CAPACITY",
        "cache_capacity",
        _CACHE_CAPACITY,
        "tensors remembered so steady-state negotiation is a bit-vector allreduce; 0 disables",
    ),
    (
        "COMMLAYER_COMPRESSION",
        "compression",
        _REGISTERED,
        "DistributedOptimizer's default gradient compressor, e.g. 'fp16', 'topk:ratio=0.01', "
        "'qsgd:levels=127,bucket=512', or 'auto' (per bucket from the measured link; "
        "'auto:lossy=1' allows lossy ones); default none",
    ),
    (
        "COMMLAYER_COMPRESSION_HIERARCHY",
        "compression_hierarchy",
        _HIERARCHY,
        "where a compressed bucket is compressed when its process set spans several hosts and "
        "some host holds more than one of its ranks: flat (every rank its own gradients), host "
        "(the host's ranks sum the bucket uncompressed, one leader a bucket compresses, the "
        "leaders exchange across hosts, the result is shared inside the host), or auto "
        "(default: DistributedOptimizer decides per bucket from the links it measures and the "
        "compressor's cost; flat for a process set other than the global one and in the DDP "
        "hook); a spec's hierarchy= wins for its compressor",
    ),
    (
        "COMMLAYER_TIMELINE",
        "timeline_path",
        _PATH,
        "write a Chrome trace here (rank 0; '{rank}' in the path makes one file per rank)",
    ),
    (
        "COMMLAYER_STALL_CHECK_TIME_SECONDS",
        "stall_check_time_s",
        _TIMEOUT_OR_OFF,
        "warn, naming tensor and missing ranks, after this long; 0 disables; default 60",
    ),
    (
        "COMMLAYER_STALL_SHUTDOWN_TIME_SECONDS",
        "stall_shutdown_time_s",
        _TIMEOUT_OR_OFF,
        "fail a stalled operation with StallError after this long, on every rank, and stop "
        "commlayer there (the job ends when the error goes uncaught); 0 = never; default 600 "
        "(10 minutes, NCCL's watchdog default: above a slow first step, a checkpoint or an "
        "evaluation that one rank runs while the others wait, below a job idling out its "
        "allocation)",
    ),
    (
        "COMMLAYER_LOG_LEVEL",
        "log_level",
        _LOG_LEVEL,
        "logging level of the 'commlayer' logger; default info: rank 0 logs one line at init() "
        "saying what the job got (ranks, hosts, backend, algorithm, compression, fusion); "
        "warning leaves it out",
    ),
    (
        "COMMLAYER_ALLREDUCE_ALGORITHM",
        "allreduce_algorithm",
        _REGISTERED,
        "allreduce algorithm for fused buffers: auto (default), native (the backend's own; mpi, "
        "its former name, is an alias), shm, or a schedule "
        "(hierarchical, rabenseifner, recursive_doubling, ring, shd, swing, torus2d, tree); "
        "the same on every rank",
    ),
    (
        "COMMLAYER_TOPOLOGY",
        "topology",
        _REGISTERED,
        "override the detected topology (tests, simulation): nodes=N,local=L (rank r on node "
        "r // L) and/or torus=RxC for torus2d",
    ),
    (
        "COMMLAYER_SPARSE_ALGORITHM",
        "sparse_algorithm",
        _REGISTERED,
        "how DistributedOptimizer reduces top-k payloads: allgather (default), auto, dsar, gtopk, "
        "ssar_recursive_doubling, ssar_split_allgather, topo_sparse; the same on every rank",
    ),
    (
        "COMMLAYER_KERNELS",
        "kernels",
        _REGISTERED,
        "implementation of the sparse kernels: auto (default: cupy, numba, torch as available), "
        "cupy, numba, torch",
    ),
    (
        "COMMLAYER_CUDA_PTX_DIR",
        "cuda_ptx_dir",
        _PATH,
        "folder holding prebuilt sparse_kernels.ptx (else build/ext/cuda, else NVRTC)",
    ),
    (
        "COMMLAYER_WAIT_POLICY",
        "wait_policy",
        _WAIT_POLICY,
        "how the engine thread waits on a collective: active yields the CPU between tests until "
        "it completes (lowest latency), passive does so for 200 us and then sleeps between "
        "tests, up to 250 us (leaves the cores to forward and backward); auto (default): "
        "passive when this node runs more ranks than it has cores (the torch backend counts "
        "a core per rank for gloo's thread too), else active",
    ),
    (
        "COMMLAYER_MALLOC_TUNING",
        "malloc_tuning",
        _BOOL,
        "on (default): init() sets glibc's mmap threshold to 32 MiB and its trim threshold to "
        "64 MiB, so the memory a training step frees serves the next step without page faults "
        "(skipped when glibc's own MALLOC_*_ or GLIBC_TUNABLES malloc settings are set); off",
    ),
    (
        "COMMLAYER_LINE_OUTPUT",
        "line_output",
        _BOOL,
        "on: init() makes sys.stdout and sys.stderr line-buffered, so that each printed line "
        "reaches the launcher in one write; commlayerrun sets it when MPICH's launcher puts the "
        "rank before each write of a rank's output (--prefix-output: under PYTHONUNBUFFERED=1 "
        "print() writes a line in pieces); off (default): output as Python buffers it",
    ),
    (
        "COMMLAYER_AUTO_TUNING",
        "auto_tuning",
        _BOOL,
        "on (default): the auto algorithm times the cost model's pick, the native algorithms "
        "and the two schedules predicted fastest on the first calls of each buffer size class "
        "and keeps the fastest, agreed by all ranks, measuring it against the runner-up again "
        "now and then (<= 2% of the calls); off: the cost model's pick alone",
    ),
    (
        "COMMLAYER_JOIN_MODE",
        "join_mode",
        _JOIN_MODE,
        "collectives while ranks have joined: horovod (default, as Horovod): a joined rank "
        "adds zeros, Average divides by size(), allgather, broadcast, alltoall and "
        "reducescatter raise; active: Average divides by the ranks not joined, allgather and "
        "reducescatter run over them, broadcast from a rank not joined works",
    ),
    (
        "COMMLAYER_INIT_TIMEOUT_SECONDS",
        "init_timeout_s",
        _TIMEOUT,
        "how long init() waits for every rank to call it (also after shutdown()) before it "
        "raises, naming this rank; default 60",
    ),
    (
        "COMMLAYER_COLLECTIVE_TIMEOUT_SECONDS",
        "collective_timeout_s",
        _TIMEOUT_OR_OFF,
        "watchdog: a collective (or negotiation) of which nothing completes for this long fails "
        "with CollectiveTimeoutError naming it and the ranks and hosts it waits on, and the job "
        "aborts (MPI_Abort: every rank exits non-zero); 0 disables; default 60",
    ),
    (
        "COMMLAYER_BACKEND",
        "backend",
        _REGISTERED,
        "what carries the engine's messages: mpi (mpi4py), torch (torch.distributed over gloo), "
        "loopback (one rank, no library), or auto (default): mpi under mpiexec/commlayerrun, "
        "torch under torchrun or (no launcher) when torch.distributed is already initialized, "
        "else mpi",
    ),
    (
        "COMMLAYER_CUDA_AWARE_MPI",
        "cuda_aware_mpi",
        _AUTO_BOOL,
        "whether the MPI backend hands CUDA tensors to MPI directly: on (the MPI is CUDA-aware), "
        "off (stage them through pinned host buffers), or auto (default): ask the MPI library "
        "(MPIX_Query_cuda_support, MPICH's MPIX_GPU_query_support; MPIR_CVAR_ENABLE_GPU=0 "
        "says no), staging when it cannot tell",
    ),
    (
        "COMMLAYER_NCCL",
        "nccl",
        _AUTO_BOOL,
        "whether the torch backend moves CUDA tensors over NCCL directly: auto (default) and on "
        "when torch has CUDA and NCCL and every rank a GPU of its own (on: an error otherwise), "
        "off: stage them through pinned host buffers over gloo",
    ),
    (
        "COMMLAYER_FORCE_FULL_PATH",
        "force_full_path",
        _BOOL,
        "off (default): over one rank (a process set or DDP group of size 1) DistributedOptimizer "
        "and the DDP hook leave gradients as backward made them, as Horovod does at size 1 (no "
        "hooks, nothing sent, no compression); on: they take the whole path there too (hooks, "
        "buckets, compression, the engine), for benchmarks and tests. Collectives called "
        "directly run through the engine at any size",
    ),
    (
        "COMMLAYER_PLANNED_SKIP_NEGOTIATION",
        "planned_skip_negotiation",
        _BOOL,
        "off (default): DistributedOptimizer's planned buckets are negotiated every step as any "
        "operation; on (opt-in): each plan's uncompressed CPU buckets are reduced in plan "
        "order on a communicator of their own, without negotiation, each reduction checking "
        "that every rank sent the same step and bucket (docs/planned_lanes.md)",
    ),
    (
        "COMMLAYER_WINDOW_BUCKETS",
        "window_buckets",
        _BOOL,
        "on: DistributedOptimizer allocates its planned uncompressed CPU buckets in a "
        "shared-memory window of their own where every rank of its process set is on one "
        "machine (backward writes the gradients into the window; each rank reduces its slice "
        "there and writes it into the others' buckets: no copy in, one copy out), else as off; "
        "off (default): buckets in process memory, reduced by the allreduce algorithm",
    ),
    (
        "COMMLAYER_SIM_TABLE",
        "sim_table",
        _REGISTERED,
        "JSON-lines file(s) of `commlayer simulate --format json` for the machine the job runs "
        "on (several joined by ':'): auto picks the algorithm they predict fastest for the "
        "job's ranks, GPUs per node and size (simulated points, else the cost model corrected "
        "by them) before any calibration, where they fit the job; default none",
    ),
)

_FIELDS = {field.name for field in dataclasses.fields(Config)}
# The fields that need a Validator passed in (commlayer.core.registries.REGISTRIES has one each).
REGISTERED_FIELDS = tuple(field for _, field, found, _ in _VARIABLES if found is _REGISTERED)
_override_lock = threading.Lock()
_overrides: list[dict[str, Any]] = []


def cache_dir() -> Path:
    """Where commlayer keeps what it measured on this machine: $XDG_CACHE_HOME/commlayer, else
    ~/.cache/commlayer. (A system variable, not a COMMLAYER_* one, read here with the others.)"""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "commlayer"


# Variables a launcher sets in every process it starts (system ones, read here with the others).
_TORCHRUN_VARIABLES = ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_RANK")
_MPI_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process was started: ``launcher`` is "torchrun", "mpi" or "" (a plain
    process); ``world_size`` is what torchrun says the job's size is (0 when not torchrun);
    ``attempt``: torchrun's count of restarts of the job's workers (TORCHELASTIC_RESTART_COUNT,
    ``--max-restarts``), "" when not torchrun."""

    launcher: str
    world_size: int = 0
    attempt: str = ""


def launch(environ: Mapping[str, str] | None = None) -> Launch:
    """Which launcher started this process, from the variables it sets (torchrun's RANK,
    WORLD_SIZE and TORCHELASTIC_RUN_ID...; mpiexec's PMI_*/OMPI_* ones)."""
    env = os.environ if environ is None else environ
    if any(name in env for name in _TORCHRUN_VARIABLES) and "WORLD_SIZE" in env:
        try:
            size = int(env["WORLD_SIZE"])
        except ValueError:
            raise ConfigError(
                f"WORLD_SIZE={env['WORLD_SIZE']!r} (set by torchrun) is not an integer"
            ) from None
        return Launch("torchrun", size, env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if any(name in env for name in _MPI_VARIABLES):
        return Launch("mpi")
    return Launch("")


@dataclasses.dataclass(frozen=True)
class SlurmAllocation:
    """The Slurm allocation this process runs in (system variables, read here with the
    others): ``tasks`` (SLURM_NTASKS, the ranks it holds), ``cpus_per_task``
    (SLURM_CPUS_PER_TASK, 0 when not given), ``nodes`` (SLURM_JOB_NODELIST, Slurm's compact
    form)."""

    tasks: int
    cpus_per_task: int = 0
    nodes: str = ""


@dataclasses.dataclass(frozen=True)
class ElasticWorker:
    """A worker started by commlayerrun's elastic driver (commlayer/launch/driver.py): the
    driver's ``host:port``, the job key and this worker's name. Set by the driver only."""

    driver: str
    key: bytes = dataclasses.field(repr=False)
    worker: str


# The elastic driver's variables: read by elastic_worker(), not settings of Config.
_ELASTIC_VARIABLES = (
    "COMMLAYER_ELASTIC_DRIVER",
    "COMMLAYER_ELASTIC_KEY",
    "COMMLAYER_ELASTIC_WORKER",
)


# The job key, once read from this process's environment and removed from it (elastic_worker)
_elastic_key: str | None = None
_elastic_lock = threading.Lock()


def _job_key() -> str:
    """COMMLAYER_ELASTIC_KEY of this process: taken out of os.environ at the first read, so that
    what the training script starts (DataLoader workers, a shell, any subprocess) does not
    inherit the job's key; later calls (a re-init after the world re-formed) get it from here."""
    global _elastic_key
    with _elastic_lock:
        if "COMMLAYER_ELASTIC_KEY" in os.environ:
            _elastic_key = os.environ.pop("COMMLAYER_ELASTIC_KEY")
        return _elastic_key or ""


def elastic_worker(environ: Mapping[str, str] | None = None) -> ElasticWorker | None:
    """This process as an elastic driver's worker, None when the driver did not start it.
    Reading this process's environment removes the job key from it (``_job_key``)."""
    env = os.environ if environ is None else environ
    if "COMMLAYER_ELASTIC_DRIVER" not in env:
        return None
    text = _job_key() if environ is None else env.get("COMMLAYER_ELASTIC_KEY", "")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16 or not env.get("COMMLAYER_ELASTIC_WORKER"):
        raise ConfigError(
            "COMMLAYER_ELASTIC_DRIVER is set but COMMLAYER_ELASTIC_KEY (the job key, hex) or "
            "COMMLAYER_ELASTIC_WORKER is missing or bad: these are set by commlayerrun's "
            "elastic driver for the workers it starts, not by hand"
        )
    return ElasticWorker(env["COMMLAYER_ELASTIC_DRIVER"], key, env["COMMLAYER_ELASTIC_WORKER"])


def slurm_allocation(environ: Mapping[str, str] | None = None) -> SlurmAllocation | None:
    """The Slurm allocation (inside ``sbatch``/``salloc``), None outside one or where Slurm
    does not say how many tasks it holds."""
    env = os.environ if environ is None else environ
    text = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or ""
    if "SLURM_JOB_ID" not in env or not text.strip().isdigit() or int(text) < 1:
        return None
    cpus = env.get("SLURM_CPUS_PER_TASK", "").strip()
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    return SlurmAllocation(int(text), int(cpus) if cpus.isdigit() else 0, nodes)


# glibc's own malloc settings (environment variables and tunables): a user who set one has
# chosen, and commlayer's tuning (commlayer/core/malloc.py) leaves malloc alone.
_GLIBC_MALLOC_VARIABLES = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)


def glibc_malloc_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """The glibc malloc settings present in the environment (system variables, read here with
    the others): MALLOC_*_ thresholds, and GLIBC_TUNABLES when it names a glibc.malloc one."""
    env = os.environ if environ is None else environ
    found = [name for name in _GLIBC_MALLOC_VARIABLES if name in env]
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        found.append("GLIBC_TUNABLES")
    return found


# MPICH's switch for its GPU support: off, it reads every buffer as host memory whatever its
# queries say (backends/cuda_aware.py ``decide``).
_MPI_GPU_VARIABLES = ("MPIR_CVAR_ENABLE_GPU",)


def mpi_gpu_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The MPI library's own GPU settings present in the environment (system variables, read
    here with the others), by name."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in _MPI_GPU_VARIABLES if name in env}


def variables() -> list[tuple[str, str]]:
    """(name, help) of every environment variable commlayer reads, for docs and --help."""
    return [(name, help_text) for name, _, _, help_text in _VARIABLES]


Registries = Mapping[str, Validator]  # Config field -> its Validator, for REGISTERED_FIELDS
_installed: Registries = {}


@dataclasses.dataclass(frozen=True)
class Variable:
    """One COMMLAYER_* variable as the reference documents it (``describe()``)."""

    name: str  # COMMLAYER_...
    field: str  # the Config field, also init()'s keyword
    default: Any  # Config's default value
    unit: str  # 'milliseconds', 'seconds', 'bytes' or ''
    allowed: str  # what a ConfigError says is allowed
    help: str


def describe(registries: Registries | None = None) -> list[Variable]:
    """Every variable with its field, default, unit and what it allows, in declaration order:
    the documentation's configuration reference is generated from this (scripts/docs_hooks.py).
    ``registries``: the Validators of REGISTERED_FIELDS (default: the installed ones)."""
    defaults = Config()
    return [
        Variable(
            name,
            field,
            getattr(defaults, field),
            unit(field),
            _validator(field, declared, registries).allowed(),
            help_text,
        )
        for name, field, declared, help_text in _VARIABLES
    ]


def show_default(variable: Variable) -> str:
    """The default as a user writes it: '64 MiB' for 67108864 bytes, '60' for 60.0 seconds,
    'none' for an empty path, 'on'/'off' for a boolean, 'auto' for an auto boolean's None."""
    value = variable.default
    if variable.unit == "bytes" and isinstance(value, int):
        for shift, suffix in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
            if value and value % (1 << shift) == 0:
                return f"{value >> shift} {suffix}"
        return f"{value} B"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, bool) or value is None:  # a boolean setting; None: an auto one's
        return "auto" if value is None else "on" if value else "off"
    return str(value) if value != "" else "none"


def install_registries(registries: Registries) -> None:
    """The registries used when a caller passes none (``load()``, ``override()``,
    ``parse_variable()``); core/runtime.py installs core/registries.py's REGISTRIES on import."""
    global _installed
    _installed = dict(registries)


def _validator(field: str, declared: Validator | None, registries: Registries | None) -> Validator:
    if declared is not None:
        return declared
    found = (_installed if registries is None else registries).get(field)
    if found is None:
        raise ConfigError(
            f"setting {field} names something config does not know: pass its registry "
            f"(config.load(registries=commlayer.core.registries.REGISTRIES))"
        )
    return found


# A field's unit, from its name's suffix (Config: "units are in the field names").
_UNITS = {"_ms": "milliseconds", "_s": "seconds", "_bytes": "bytes"}
_NUMBER_WITH_SUFFIX = re.compile(r"^\s*[-+0-9.eE]+\s*[A-Za-z]+\s*$")


def unit(field: str) -> str:
    """'milliseconds', 'seconds', 'bytes' or '' for a Config field, from its name."""
    for suffix, name in _UNITS.items():
        if field.endswith(suffix):
            return name
    return ""


def _expected(field: str, validator: Validator, text: str) -> str:
    """What a ConfigError says is allowed, with the setting's unit where it has one that the
    text cannot carry (seconds, milliseconds): 'a finite number > 0, in milliseconds (the
    unit is fixed: write 1, not 1ms)'."""
    allowed = validator.allowed()
    name = unit(field)
    if name in ("", "bytes"):  # bytes: the text takes K/M/G suffixes, the message says so
        return allowed
    allowed += f", in {name}"
    if _NUMBER_WITH_SUFFIX.match(text):
        number = re.match(r"^\s*([-+0-9.eE]+)", text)
        assert number is not None
        allowed += f" (the unit is fixed: write {number.group(1)}, not {text.strip()})"
    return allowed


def parse_variable(name: str, text: str, registries: Registries | None = None) -> Any:
    """Parse one variable's text; ConfigError names the variable, value, what is allowed and
    its unit."""
    for var, field, declared, _ in _VARIABLES:
        if var == name:
            return _parse_or_explain(field, declared, registries, text, f"{name}={text!r}")
    known = sorted(var for var, _, _, _ in _VARIABLES)
    raise ConfigError(f"unknown commlayer variable {name!r}{did_you_mean([name], known)}")


def _check_settings(
    settings: Mapping[str, Any], registries: Registries | None = None
) -> dict[str, Any]:
    """Explicit settings (``load(**kw)``, ``init(**kw)``, ``override(**kw)``) parsed by the same
    parsers as the environment, so ``cache_capacity=-3`` is refused like
    ``COMMLAYER_CACHE_CAPACITY=-3`` instead of breaking the engine later. None means unset."""
    bad = sorted(set(settings) - _FIELDS)
    if bad:
        raise ConfigError(
            f"unknown setting(s) {bad}{did_you_mean(bad, sorted(_FIELDS))}; "
            f"known: {sorted(_FIELDS)}"
        )
    checked: dict[str, Any] = {}
    for var, field, declared, _ in _VARIABLES:
        value = settings.get(field)
        if value is None:
            continue
        # True/False only for a boolean setting (True would be 1 to an integer one)
        misread = isinstance(value, bool) and declared not in (_BOOL, _AUTO_BOOL)
        checked[field] = _parse_or_explain(
            field, declared, registries, str(value), f"setting {field}={value!r} (or {var})",
            refuse=misread or not isinstance(value, (str, int, float)),
        )  # fmt: skip
    return checked


def _parse_or_explain(
    field: str,
    declared: Validator | None,
    registries: Registries | None,
    text: str,
    what: str,
    refuse: bool = False,
) -> Any:
    """``text`` parsed by ``field``'s validator; ConfigError naming ``what`` (the variable or the
    setting and its value), why, and what is allowed. ``refuse``: not valid whatever the text
    (a value of the wrong Python type)."""
    validator = _validator(field, declared, registries)
    try:
        if refuse:
            raise ValueError(text)
        return validator.parse(text)
    except ValueError as exc:
        why = f" ({exc})" if isinstance(exc, InvalidValue) else ""
        raise ConfigError(
            f"{what} is not valid{why}: expected {_expected(field, validator, text)}"
        ) from None


def did_you_mean(unknown: Sequence[str], known: Sequence[str]) -> str:
    """' (did you mean COMMLAYER_COMPRESSION?)' for the known names most like each unknown one
    (``_likeness``: word by word, so COMMLAYER_ALGORITHM finds both *_ALGORITHM variables and a
    misspelt word still counts), '' when none is close."""
    guesses = []
    for name in unknown:
        scored = sorted(((_likeness(name, k), k) for k in known), reverse=True)
        best = scored[0][0] if scored else 0.0
        close = [k for score, k in scored[:_MOST_GUESSES] if score >= max(0.5, best - 0.1)]
        if close:
            said = " or ".join(sorted(close))
            guesses.append(f"{name} -> {said}" if len(unknown) > 1 else said)
    return f" (did you mean {', '.join(guesses)}?)" if guesses else ""


_MOST_GUESSES = 3


def _words(name: str) -> list[str]:
    return [w for w in name.upper().removeprefix("COMMLAYER_").lower().split("_") if w]


def _word_likeness(typed: str, known: str) -> float:
    """difflib's ratio; a word cut short (ALGO for ALGORITHM) counts as 0.8."""
    if len(typed) >= 3 and known.startswith(typed):
        return max(0.8, difflib.SequenceMatcher(None, typed, known).ratio())
    return difflib.SequenceMatcher(None, typed, known).ratio()


def _likeness(typed: str, known: str) -> float:
    """0 to 1: each word of ``typed`` paired with the most alike unused word of ``known``
    (difflib's ratio, counted from 0.75, so COMPRESION is COMPRESSION), the matched share of
    both names' words averaged (a missing or an extra word costs less than a wrong one); or
    the letters of both alike, for words run together (FUSIONTHRESHOLD)."""
    mine, theirs = _words(typed), _words(known)
    if not mine or not theirs:
        return 0.0
    unused, matched = list(theirs), 0.0
    for word in mine:
        ratio, best = max((_word_likeness(word, w), w) for w in unused)
        if ratio >= 0.75:
            matched += ratio
            unused.remove(best)
        if not unused:
            break
    by_words = (matched / len(mine) + matched / len(theirs)) / 2
    letters = difflib.SequenceMatcher(None, "".join(mine), "".join(theirs)).ratio()
    return max(by_words, letters if letters >= 0.85 else 0.0)


def _check_unknown(environ: Mapping[str, str]) -> None:
    known = sorted(var for var, _, _, _ in _VARIABLES)
    unknown = sorted(
        k
        for k in environ
        if k.startswith("COMMLAYER_") and k not in known and k not in _ELASTIC_VARIABLES
    )
    if unknown:
        guess = did_you_mean(unknown, known)
        # With a guess the 26 names would bury it: the reference page lists them all.
        rest = (
            "; every variable: the documentation's Configuration page"
            if guess
            else "; known:\n  " + "\n  ".join(textwrap.wrap(", ".join(known), 96))
        )
        names = ", ".join(map(repr, unknown))
        raise ConfigError(f"unknown environment variable(s) {names}{guess}{rest}")


def load(
    environ: Mapping[str, str] | None = None,
    *,
    registries: Registries | None = None,
    **explicit: Any,
) -> Config:
    """Config from the environment, then active overrides, then explicit keyword arguments.
    ``registries``: the Validators of REGISTERED_FIELDS (default: the installed ones)."""
    env = os.environ if environ is None else environ
    _check_unknown(env)
    values: dict[str, Any] = {}
    for var, field, _, _ in _VARIABLES:
        if var in env and env[var] != "":
            values[field] = parse_variable(var, env[var], registries)
    values.update(overrides())
    values.update(_check_settings(explicit, registries))
    return Config(**values)


@contextlib.contextmanager
def override(**settings: Any) -> Iterator[None]:
    """Temporarily override settings (tests): ``with override(cycle_time_ms=0.5): ...``.
    Seen by ``load()``, ``runtime.config()`` and the kernels' dispatch, also after ``init()``."""
    layer = _check_settings(settings)
    with _override_lock:
        _overrides.append(layer)
    try:
        yield
    finally:
        with _override_lock:
            _overrides[:] = [other for other in _overrides if other is not layer]


def overrides() -> dict[str, Any]:
    """The settings of the active ``override()`` blocks, innermost winning; {} outside any (the
    common case returns at the first test: the kernels' dispatch asks on every call)."""
    if not _overrides:
        return {}
    merged: dict[str, Any] = {}
    with _override_lock:
        for layer in _overrides:
            merged.update(layer)
    return merged


def launcher_environ(registries: Registries | None = None) -> dict[str, str]:
    """A copy of this process's whole environment, COMMLAYER_* validated (ConfigError), for a
    launcher to hand to the ranks it starts."""
    env = dict(os.environ)
    load(environ=env, registries=registries)
    return env
