"""The direct path's decisions, without a GPU: CUDA-aware MPI detection and its setting
(backends/cuda_aware.py), the torch backend's NCCL choice (torch_distributed.nccl_wanted), and
device.path, the one decision the seam acts on."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
import torch

from commlayer.backends import cuda_aware
from commlayer.backends.base import DIRECT_PATHS
from commlayer.backends.torch_distributed import nccl_wanted
from commlayer.common import config
from commlayer.common.errors import CommlayerError
from commlayer.core import device


def _says(answer: bool | None, name: str = "q"):  # type: ignore[no-untyped-def]
    def query() -> bool | None:
        return answer

    query.__name__ = name
    return query


def _fails() -> bool | None:
    raise OSError("no such symbol")


@pytest.mark.parametrize(
    ("setting", "environ", "answers", "expected"),
    [
        ("1", {}, [False], True),  # the user's word wins over the library's
        ("0", {}, [True], False),
        ("auto", {}, [True], True),
        ("auto", {}, [False, True], False),  # the first query that tells decides
        ("auto", {}, [None, True], True),  # one that cannot tell is skipped
        ("auto", {}, [None, None], False),  # nothing tells: stage (the safe side)
        ("auto", {}, [], False),
        ("auto", {"MPIR_CVAR_ENABLE_GPU": "0"}, [True], False),  # MPICH's GPU support off
        ("auto", {"MPIR_CVAR_ENABLE_GPU": "1"}, [True], True),
        ("1", {"MPIR_CVAR_ENABLE_GPU": "0"}, [False], True),
    ],
)
def test_decide(setting: str, environ: dict, answers: list, expected: bool) -> None:
    aware, why = cuda_aware.decide(
        config.parse_auto_bool(setting), environ, [_says(a, f"q{i}") for i, a in enumerate(answers)]
    )
    assert aware is expected
    assert why


def test_decide_names_what_decided() -> None:
    assert cuda_aware.decide(None, {}, [_says(None, "a"), _says(True, "b")])[1] == "b() says yes"
    assert "MPIR_CVAR_ENABLE_GPU" in cuda_aware.decide(None, {"MPIR_CVAR_ENABLE_GPU": "off"}, [])[1]
    assert "COMMLAYER_CUDA_AWARE_MPI=on" in cuda_aware.decide(None, {}, [])[1]  # how to force


def test_mpich_gpu_switch_is_read_by_config() -> None:
    # config.py reads the environment (the MPI backend passes decide what it found)
    found = config.mpi_gpu_variables({"MPIR_CVAR_ENABLE_GPU": "0", "PATH": "/bin"})
    assert found == {"MPIR_CVAR_ENABLE_GPU": "0"}
    assert config.mpi_gpu_variables({}) == {}
    assert cuda_aware.decide(None, found, [_says(True)])[0] is False


def test_a_failing_query_cannot_tell() -> None:
    assert cuda_aware.decide(None, {}, [_fails, _says(True)]) == (True, "q() says yes")


def test_bad_setting_is_refused() -> None:
    with pytest.raises(config.ConfigError, match="COMMLAYER_CUDA_AWARE_MPI='maybe' is not valid"):
        config.load(environ={"COMMLAYER_CUDA_AWARE_MPI": "maybe"})


_PROBE = """
from commlayer.backends import cuda_aware, mpi
print(repr(([q() for q in cuda_aware.library_queries(mpi.MPI)], mpi.detect_cuda_aware(None))))
"""


def test_this_mpi_library_answers() -> None:
    """The ctypes queries run against the MPI library mpi4py loaded (in a process of its own:
    importing the backend initializes MPI). Without a GPU every query that tells says no."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    answers, (aware, why) = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert all(a in (None, False, True) for a in answers)
    if not torch.cuda.is_available():
        assert aware is False and True not in answers, (answers, why)


@pytest.mark.parametrize(
    ("setting", "cuda", "nccl", "crowded", "expected"),
    [
        ("auto", True, True, [], True),
        ("auto", False, False, [], False),
        ("auto", True, False, [], False),
        ("auto", True, True, ["h: 2 ranks, 1 GPUs"], False),  # two ranks on one GPU: staged
        ("0", True, True, [], False),
        ("1", True, True, [], True),
    ],
)
def test_nccl_wanted(setting: str, cuda: bool, nccl: bool, crowded: list, expected: bool) -> None:
    assert nccl_wanted(config.parse_auto_bool(setting), cuda, nccl, crowded) is expected


@pytest.mark.parametrize(
    ("cuda", "nccl", "crowded", "message"),
    [
        (False, False, [], "no CUDA"),
        (True, False, [], "no NCCL"),
        (True, True, ["h: 2 ranks, 1 GPUs"], "h: 2 ranks, 1 GPUs: NCCL needs a GPU per rank"),
    ],
)
def test_nccl_forced_where_it_cannot_run(
    cuda: bool, nccl: bool, crowded: list, message: str
) -> None:
    with pytest.raises(CommlayerError, match=f"COMMLAYER_NCCL=on, but .*{message}"):
        nccl_wanted(True, cuda, nccl, crowded)


class _Backend:
    def __init__(self, route: device.Path | None, direct: bool = True) -> None:
        self.route = route
        self.asked: list = []
        self.capabilities = frozenset({DIRECT_PATHS} if direct else ())

    def direct_path(self, where: torch.device, dtype: torch.dtype) -> device.Path | None:
        self.asked.append((where.type, dtype))
        return self.route


def test_path_asks_the_backend_for_device_tensors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    route = device.Path("stream", "nccl")
    backend = _Backend(route)
    assert device.path(backend, torch.device("cuda", 0), torch.float32) is route
    assert backend.asked == [("cuda", torch.float32)]
    assert device.path(backend, torch.device("cpu"), torch.float32) is None  # CPU: plain
    silent = _Backend(route, direct=False)  # declares no direct paths: not asked
    assert device.path(silent, torch.device("cuda", 0), torch.float32) is None  # no answer
    assert silent.asked == []
    forced = device.Path("host", "t")
    monkeypatch.setattr(device, "DIRECT_CPU", forced)
    assert device.path(backend, torch.device("cpu"), torch.float32) is forced


def test_prepare_plain_direct_and_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = torch.ones(3), torch.zeros(3)
    assert device.prepare([x], [y], _Backend(None))[2:] == (None, "")  # CPU: untouched
    route = device.Path("host", "chan")
    monkeypatch.setattr(device, "DIRECT_CPU", route)
    inputs, outputs, record, channel = device.prepare([x], [y], _Backend(None))
    assert inputs[0] is x and outputs[0] is y  # the caller's own tensors, no stand-ins
    assert isinstance(record, device.Direct) and channel == "chan"
    assert device.channel_device("chan") == torch.device("cpu")  # a joined rank's buffers
    assert record.ready.test() and record.done("r") == "r"
    monkeypatch.setattr(device, "DIRECT_CPU", None)
    monkeypatch.setattr(device, "STAGE_CPU", True)
    inputs, _, record, channel = device.prepare([x], [y], _Backend(route))
    assert inputs[0] is not x and isinstance(record, device.Staged) and channel == ""
