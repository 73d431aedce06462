"""Which backend init() starts (issue 25): torchrun is recognised from its variables, the MPI
backend is refused under a multi-process torchrun (it would make N one-rank jobs), a bad
COMMLAYER_BACKEND is an error naming it."""

from __future__ import annotations

import pytest

from commlayer import backends
from commlayer.common import config
from commlayer.common.errors import ConfigError
from commlayer.core import runtime

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "TORCHELASTIC_RUN_ID": "none",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def test_torchrun_is_recognised_with_its_world_size_and_attempt() -> None:
    assert config.launch(TORCHRUN) == config.Launch("torchrun", 4, "0")
    restarted = {**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "2"}  # --max-restarts, third try
    assert config.launch(restarted) == config.Launch("torchrun", 4, "2")


@pytest.mark.parametrize("name", ["PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE"])
def test_mpi_launchers_are_recognised(name: str) -> None:
    assert config.launch({name: "0"}).launcher == "mpi"


def test_a_plain_process_has_no_launcher() -> None:
    assert config.launch({"HOME": "/root"}) == config.Launch("")
    # RANK and WORLD_SIZE alone (set by hand, or by another tool) are not torchrun
    assert config.launch({"RANK": "0", "WORLD_SIZE": "2"}).launcher == ""


def test_a_bad_world_size_names_the_value() -> None:
    with pytest.raises(ConfigError, match="WORLD_SIZE='four'"):
        config.launch({**TORCHRUN, "WORLD_SIZE": "four"})


def test_backend_setting_is_checked() -> None:
    assert config.load({"COMMLAYER_BACKEND": " Torch "}).backend == "torch"
    assert config.load({}).backend == "auto"
    with pytest.raises(ConfigError, match="COMMLAYER_BACKEND.*'nccl'.*auto, mpi, torch"):
        config.load({"COMMLAYER_BACKEND": "nccl"})


def test_mpi_under_torchrun_is_refused_before_mpi_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(config, "launch", lambda: config.Launch("torchrun", 4))
    with pytest.raises(ConfigError, match=r"COMMLAYER_BACKEND=mpi.*WORLD_SIZE=4.*torch"):
        runtime._start_backend(None, config.load({"COMMLAYER_BACKEND": "mpi"}))


@pytest.mark.parametrize(
    ("launcher", "torch_ready", "expected"),
    [
        ("mpi", False, "mpi"),
        ("mpi", True, "mpi"),  # mpiexec made one MPI job, torch.distributed or not
        ("torchrun", False, "torch"),
        ("torchrun", True, "torch"),
        ("", True, "torch"),  # a plain process over an initialized torch.distributed
        ("", False, "mpi"),
    ],
)
def test_auto_backend(launcher: str, torch_ready: bool, expected: str) -> None:
    assert backends.auto(launcher, ["torch"] if torch_ready else []) == expected


def test_backends_are_registered_once_each_and_config_accepts_their_names() -> None:
    assert backends.available() == ["auto", "mpi", "torch", "loopback"]
    for name in ("mpi", "torch", "loopback"):
        assert config.load({"COMMLAYER_BACKEND": name}).backend == name
    with pytest.raises(ValueError, match="'mpi' is already registered"):
        backends.register(backends.registration("mpi"))
    with pytest.raises(ValueError, match="'nccl' is not a registered backend"):
        backends.unregister("nccl")


def test_a_new_backend_is_one_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plug-in registered here is accepted by config and started by init()'s choice, without
    any other module naming it."""
    monkeypatch.setattr(config, "launch", lambda: config.Launch(""))
    backends.register(backends.Registration("toy", "commlayer.backends.loopback", "toy"))
    try:
        assert "toy" in backends.available()
        cfg = config.load({"COMMLAYER_BACKEND": "toy"})
        backend = runtime._start_backend(None, cfg)
        assert (backend.rank, backend.size, runtime._backend_name) == (0, 1, "toy")
    finally:
        backends.unregister("toy")
    with pytest.raises(ConfigError, match="COMMLAYER_BACKEND='toy'"):
        config.load({"COMMLAYER_BACKEND": "toy"})


def test_an_elastic_worker_needs_a_backend_that_re_forms_its_world() -> None:
    launch = config.Launch("")
    assert backends.choose("auto", launch, elastic_worker=True).name == "torch"
    with pytest.raises(ConfigError, match="COMMLAYER_BACKEND=mpi.*MPI cannot re-form.*torch"):
        backends.choose("mpi", launch, elastic_worker=True)
