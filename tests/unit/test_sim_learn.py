"""The cost model corrected by simulated tables (commlayer/sim/learn.py), on hand-made rows:
exact points, the learned ratio in size and ranks, bad tables named by file and line, ``auto``
reading a table (costmodel.choose/ranked, COMMLAYER_SIM_TABLE) and ``commlayer algorithms
--platform``. Nothing here runs SimGrid: the simulated times are written by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from commlayer import cli, costmodel
from commlayer.common import config
from commlayer.common.errors import ConfigError
from commlayer.core.registries import REGISTRIES
from commlayer.costmodel import simulated
from commlayer.sim import learn

MiB = 1 << 20
ONE_NODE = Path(__file__).with_name("sim_table_one_node.jsonl")  # tree < ring at 1 MiB, ring at 64


def _row(algorithm: str, spec: str, ranks: int, size: int, seconds: float, gpus: int = 1) -> str:
    fields = {"algorithm": algorithm, "platform": spec, "ranks": ranks, "gpus_per_node": gpus}
    return json.dumps({**fields, "size_bytes": size, "simulated_s": seconds})


def _table(rows: list[str], tmp_path: Path, extrapolate: bool = True) -> learn.Table:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return learn.Table(learn.read([path]), extrapolate)


def _model(algorithm: str, spec: str, ranks: int, size: int) -> float:
    found = learn.Table([]).model(algorithm, learn.canonical(spec, 1), ranks, 1, size)
    assert found is not None
    return found


def test_an_exact_point_is_the_simulated_time_in_any_spelling(tmp_path: Path) -> None:
    table = _table([_row("ring", "fat-tree:nodes=8,leaf=4", 8, MiB, 1.5e-3)], tmp_path)
    got = table.predict("ring", "fat-tree:leaf=4,nodes=8,gpus-per-node=1", 8, 1, MiB)
    assert got == learn.Prediction(1.5e-3, "simulated")
    assert table.predict("ring", "fat-tree:nodes=8,leaf=4", 8, 1, 2 * MiB).source == "learned"


def test_the_ratio_is_interpolated_in_log_size_and_held_outside(tmp_path: Path) -> None:
    spec = "torus:4x4"
    rows = [_row("rabenseifner", spec, 16, s, r * _model("rabenseifner", spec, 16, s))
            for s, r in ((MiB, 2.0), (64 * MiB, 8.0))]  # fmt: skip
    table = _table(rows, tmp_path)
    middle = table.predict("rabenseifner", spec, 16, 1, 8 * MiB)  # log2: halfway
    assert middle.source == "learned" and middle.ratio == pytest.approx(4.0)
    assert middle.seconds == pytest.approx(4.0 * _model("rabenseifner", spec, 16, 8 * MiB))
    assert table.predict("rabenseifner", spec, 16, 1, 1024).ratio == pytest.approx(2.0)
    assert table.predict("rabenseifner", spec, 16, 1, 1 << 30).ratio == pytest.approx(8.0)


def test_the_ratio_across_ranks_extrapolates_at_most_one_span(tmp_path: Path) -> None:
    # one family (torus, the shape left out), ratios 1 at 16 ranks and 2 at 64
    rows = [_row("shd", "torus:4x4", 16, MiB, _model("shd", "torus:4x4", 16, MiB)),
            _row("shd", "torus:8x8", 64, MiB, 2 * _model("shd", "torus:8x8", 64, MiB))]  # fmt: skip
    table = _table(rows, tmp_path)
    assert table.ratio("shd", learn.family("torus:4x8", 1), 32, MiB) == pytest.approx(math.sqrt(2))
    assert table.ratio("shd", learn.family("torus:16x16", 1), 256, MiB) == pytest.approx(4.0)
    assert table.ratio("shd", learn.family("torus:32x32", 1), 1024, MiB) == pytest.approx(4.0)
    assert table.ratio("shd", learn.family("torus:2x2", 1), 4, MiB) == pytest.approx(0.5)
    held = _table(rows, tmp_path, extrapolate=False)
    assert held.ratio("shd", learn.family("torus:16x16", 1), 256, MiB) == pytest.approx(2.0)
    got = table.predict("shd", "torus:16x16", 256, 1, MiB)
    assert got.source == "learned" and got.seconds == pytest.approx(4 * got.model_s)


def test_without_a_row_of_the_algorithm_or_family_it_is_the_model(tmp_path: Path) -> None:
    table = _table([_row("shd", "torus:4x4", 16, MiB, 1.0)], tmp_path)
    for name, spec in (("ring", "torus:4x4"), ("shd", "dln:16"), ("shd", "torus:4x4,bw=1GBps")):
        got = table.predict(name, spec, 16, 1, MiB)
        assert got.source == "model" and got.seconds == got.model_s and got.ratio is None


def test_families_drop_the_fields_that_size_a_platform_and_keep_the_rest() -> None:
    assert learn.family("torus:4x4", 4) == learn.family("torus:8x8x4", 4) == "torus:gpus-per-node=4"
    assert learn.family("fat-tree:nodes=16,oversub=2", 1) != learn.family("fat-tree:nodes=16", 1)
    assert learn.family("torus:4x4", 1) != learn.family("torus:4x4", 4)
    assert learn.machine("dragonfly:groups=4,routers=4,gpus-per-node=4") == "dragonfly"


@pytest.mark.parametrize(
    "line, says",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"algorithm": "ring"}', "no platform, ranks, size_bytes, simulated_s"),
        (_row("ring", "flat:nodes=4", 0, MiB, 1e-3), "must be > 0"),
        (_row("ring", "flat:nodes=4", 4, MiB, -1.0), "must be > 0"),
        (_row("ring", "bogus:4", 4, MiB, 1e-3), "unknown kind 'bogus'"),
    ],
)
def test_a_bad_line_is_named_by_file_and_line(tmp_path: Path, line: str, says: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_row("ring", "flat:nodes=4", 4, MiB, 1e-3) + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=f"{path}:3: .*{says}"):
        learn.read([path])


def test_a_missing_or_empty_table_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nope.jsonl: cannot read"):
        learn.read([tmp_path / "nope.jsonl"])
    sparse = tmp_path / "sparse.jsonl"
    sparse.write_text(json.dumps({**json.loads(_row("dsar", "flat", 4, MiB, 1.0)), "density": 0.1}))
    with pytest.raises(ValueError, match="sparse.jsonl: no dense row"):
        learn.read([sparse])


def test_auto_takes_the_tables_pick_where_it_fits_the_job() -> None:
    job = learn.load(str(ONE_NODE))
    for ranks in (2, 3, 4):  # one node of 2-4 ranks: the table's points
        assert costmodel.choose(MiB // 4, 4, ranks, 1, None, simulated=job) == "tree"
        assert costmodel.choose(64 * MiB // 4, 4, ranks, 1, None, simulated=job) == "ring"
        assert costmodel.choose(MiB // 4, 4, ranks, 1, None) == "shm"  # no table: rule of thumb
        ranked = costmodel.ranked(MiB // 4, 4, ranks, 1, None, simulated=job)
        assert ranked == ["tree", "shm", "native", "ring"]
    # between the points: the model corrected by the table, one of its algorithms
    assert costmodel.choose(8 * MiB // 4, 4, 4, 1, None, simulated=job) in {"tree", "ring"}
    # 2 nodes of 2: no row, but flat is sized by its nodes: the 2-rank rows' ratios, learned
    assert {s for _, _, s in job.times(4, 2, MiB) or []} == {"learned"}
    # 8 ranks on one node: no row of 8 GPUs per node, not this table's machine
    assert job.times(8, 1, MiB) is None
    assert costmodel.choose(MiB // 4, 4, 8, 1, None, simulated=job) == "shm"


def test_auto_reads_a_resized_fat_tree_by_the_learned_correction(tmp_path: Path) -> None:
    spec = "fat-tree:nodes=16,gpus-per-node=4"
    rows = [_row(a, spec, 64, MiB, r * learn.Table([]).model(a, learn.canonical(spec, 4), 64, 4,
                                                             MiB), 4)  # type: ignore[operator]
            for a, r in (("ring", 1.0), ("shd", 50.0))]  # fmt: skip
    job = _table(rows, tmp_path).job()
    assert job.spec(128, 4) == learn.canonical("fat-tree:nodes=32", 4)
    times = job.times(128, 32, MiB)
    assert times is not None and [(n, s) for n, _, s in times] == [
        ("ring", "learned"),
        ("shd", "learned"),
    ]
    assert job.times(128, 64, MiB) is None  # 2 GPUs per node: not simulated


def test_a_table_of_several_machines_is_refused_for_auto(tmp_path: Path) -> None:
    table = _table([_row("ring", "torus:4x4", 16, MiB, 1.0), _row("ring", "dln:16", 16, MiB, 1.0)],
                   tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match=r"rows of 2 machines \(dln, torus\)"):
        table.job()


def test_comm_layer_sim_table_is_checked_at_load(tmp_path: Path) -> None:
    assert config.load(environ={"COMMLAYER_SIM_TABLE": str(ONE_NODE)},
                       registries=REGISTRIES).sim_table == str(ONE_NODE)  # fmt: skip
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_row("ring", "flat:nodes=4", 4, MiB, 1e-3) + "\nnot json\n")
    for text, says in ((str(tmp_path / "nope.jsonl"), "nope.jsonl: cannot read"),
                       (str(bad), "bad.jsonl:2: not JSON")):  # fmt: skip
        with pytest.raises(ConfigError) as caught:
            config.load(environ={"COMMLAYER_SIM_TABLE": text}, registries=REGISTRIES)
        message = str(caught.value)
        assert "COMMLAYER_SIM_TABLE" in message and says in message, message


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["algorithms", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_predicts_on_a_platform_and_says_where_each_cell_came_from(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, err = _cli(capsys, "--platform", "flat:nodes=1", "--gpus-per-node", "4",
                        "--size", "1MiB,8MiB", "--sim-table", str(ONE_NODE))  # fmt: skip
    assert rc == 0, err
    first, second = out.splitlines()[1:3]
    assert "tree 100 us (" in first and "x, simulated), ring 500 us (" in first
    assert "learned x" in second and "x, model)" in first  # swing, torus2d...: no rows of them
    rc, out, _ = _cli(capsys, "--platform", "flat:nodes=1", "--gpus-per-node", "4",
                      "--size", "1MiB", "--format", "json")  # fmt: skip
    cells = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and {c["source"] for c in cells} == {"model"}
    assert all(c["predicted_s"] == c["model_s"] > 0 for c in cells)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--platform", "bogus:3", "--ranks", "4"], "unknown kind 'bogus'"),
        (["--platform", "torus:4x4", "--gpus-per-node", "0"], "--gpus-per-node 0"),
        (["--platform", "fat-tree:leaf=4"], "give its size"),
        (["--sim-table", "x.jsonl"], "need --platform"),
    ],
)
def test_cli_bad_input_is_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2 and not out and says in err and len(err.strip().splitlines()) == 1, err


def test_cli_bad_table_line_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"algorithm": "ring", "platform": "flat"}\n')
    rc, out, err = _cli(capsys, "--platform", "flat", "--ranks", "4", "--sim-table", str(bad))
    assert rc == 2 and not out and len(err.strip().splitlines()) == 1
    assert f"{bad}:1: no ranks, size_bytes, simulated_s" in err


def test_the_engine_hands_auto_the_agreed_table() -> None:
    from types import SimpleNamespace

    from commlayer.core import startup

    alone = SimpleNamespace(size=1, rank=0)
    assert startup.agreed_sim_table(alone, "") is None  # type: ignore[arg-type]
    job = startup.agreed_sim_table(alone, str(ONE_NODE))  # type: ignore[arg-type]
    assert job is not None and job.times(4, 1, MiB)[0][0] == "tree"  # type: ignore[index]


# -- the runtime's own reader (costmodel/simulated.py): what auto reads of COMMLAYER_SIM_TABLE --
def _reader(rows: list[str], tmp_path: Path) -> simulated.Table:
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return simulated.load(str(path))


def test_the_runtime_reader_interpolates_in_log_size_at_the_jobs_rank_count(
    tmp_path: Path,
) -> None:
    rows = [_row("ring", "flat:nodes=2", 4, MiB, 1e-3, gpus=2),
            _row("ring", "flat:nodes=2", 4, 4 * MiB, 4e-3, gpus=2),
            _row("tree", "flat:nodes=2", 4, MiB, 2e-3, gpus=2),
            _row("tree", "flat:nodes=2", 8, MiB, 1e-4, gpus=4)]  # fmt: skip
    table = _reader(rows, tmp_path)
    assert table.times(4, 2, MiB) == [("ring", 1e-3, "simulated"), ("tree", 2e-3, "simulated")]
    (ring, seconds, source), tree = table.times(4, 2, 2 * MiB) or []
    assert (ring, source) == ("ring", "interpolated") and math.isclose(seconds, 2e-3)
    assert tree == ("tree", 4e-3, "scaled")  # one size simulated: proportional
    name, seconds, source = (table.times(4, 2, 16 * MiB) or [])[0]
    assert (name, source) == ("ring", "extrapolated") and math.isclose(seconds, 16e-3)
    assert table.times(4, 1, MiB) is None  # 4 GPUs per node at 4 ranks: not simulated
    assert table.times(6, 2, MiB) is None  # no row at 6 ranks: auto uses the model
    same = simulated.from_bytes(simulated.to_bytes(table))
    assert same.times(4, 2, 2 * MiB) == table.times(4, 2, 2 * MiB)


def test_the_runtime_reader_refuses_two_machines_and_names_a_bad_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"rows of 2 machines \(dln, torus\)"):
        _reader([_row("ring", "torus:4x4", 16, MiB, 1.0), _row("ring", "dln:16", 16, MiB, 1.0)],
                tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match=r"r.jsonl:2: not JSON"):
        _reader([_row("ring", "torus:4x4", 16, MiB, 1.0), "{oops"], tmp_path)
