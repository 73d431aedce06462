"""The backend's own allreduce is named ``native`` (MPI's, gloo's or NCCL's); ``mpi``, its former
name, is an alias that works everywhere a name is given: the setting, init(), the selection,
the cost model, calibrations and simulated tables written before the rename. Listings show
``native``."""

from __future__ import annotations

import json

import pytest

from commlayer import algorithms, costmodel
from commlayer.common import config
from commlayer.core.selection import Allreducer
from commlayer.costmodel import calibration, simulated


def test_the_listing_shows_native_and_the_alias_is_accepted() -> None:
    assert "native" in algorithms.available() and "mpi" not in algorithms.available()
    assert "mpi" in algorithms.accepted()
    assert algorithms.check_name("mpi") == algorithms.check_name("native") == "native"
    assert "native" in costmodel.candidates(True) and "mpi" not in costmodel.candidates(True)
    with pytest.raises(ValueError, match="already registered"):
        algorithms.register("mpi")(lambda *args: [])


@pytest.mark.parametrize("given", ["mpi", "MPI", " native "])
def test_the_setting_and_init_give_native(given: str) -> None:
    environ = {"COMMLAYER_ALLREDUCE_ALGORITHM": given}
    assert config.load(environ=environ).allreduce_algorithm == "native"
    assert (
        config.load(environ={}, allreduce_algorithm=given.strip()).allreduce_algorithm == "native"
    )
    assert Allreducer(given.strip().lower()).algorithm == "native"


def test_an_unknown_name_lists_native() -> None:
    with pytest.raises(config.ConfigError, match=r"one of auto, native, shm, .*mpi: native"):
        config.load(environ={"COMMLAYER_ALLREDUCE_ALGORITHM": "nccl"})


def test_a_calibration_keyed_mpi_reads_as_native(tmp_path: pytest.TempPathFactory) -> None:
    raw = {
        "size": 2, "nodes": 1, "alpha_s": 1e-5, "beta_s_per_byte": 1e-9,
        "gamma_s_per_byte": 1e-10, "copy_s_per_byte": 1e-10,
        "native": {"mpi": [[1024, 5e-6], [1 << 20, 5e-4]], "shm": [[1024, 9e-6]]},
    }  # fmt: skip
    path = tmp_path / "calibration.json"  # type: ignore[operator]
    path.write_text(json.dumps({"size=2,nodes=1": raw}))
    cal = calibration.load(2, 1, path)
    assert cal is not None and sorted(cal.native) == ["native", "shm"]
    assert costmodel.predict("mpi", 256, 4, cal) == costmodel.predict("native", 256, 4, cal)
    assert costmodel.predict("native", 256, 4, cal) == pytest.approx(5e-6)


def test_a_simulated_row_named_mpi_reads_as_native() -> None:
    line = json.dumps(
        {"algorithm": "mpi", "platform": "p", "ranks": 2, "size_bytes": 8, "simulated_s": 1.0}
    )
    row = simulated.parse_line(line, "t:1")
    assert row is not None and row.algorithm == "native"
