"""Every command in the docstring of a script in examples/ runs verbatim, as a user types it
(conftest's ``run_as_typed``: bash, in a fresh directory that has examples/, this environment's
launchers first on PATH), and does what the docstring says: the ranks end with the same
weights, the loss falls, rank 0 alone writes the checkpoint and a second run resumes from it,
metrics are averaged over the ranks after a learning-rate warm-up, compression sends fewer bytes
(also when COMMLAYER_COMPRESSION chooses it), the DDP hook trains, the Lightning Trainer trains
on its shard, each model-parallel strategy matches one process's training. A docstring command
that no test here (or the one named in ``ELSEWHERE``) checks fails
``test_every_docstring_command_is_checked``. examples/elastic/ has its own test
(test_elastic_example.py).

The jobs are mostly two ranks importing torch: 6-10 s each on the 2-core machine at load
average 5 (torchrun's agent adds a few, Lightning's import 5-10, 4 ranks twice that).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
RANKS = 2
# Two ranks importing torch took 6-10 s at load average 5; 4 ranks (model_parallel_cnn) and
# Lightning longer.
TIMEOUT_S = 120.0


@dataclasses.dataclass
class Ran:
    """What one documented command printed, with helpers for the checks."""

    command: str
    code: int
    stdout: str
    stderr: str
    cwd: Path

    def output(self) -> str:
        return (
            f"$ {self.command}\nexit code {self.code}\n--- stdout ---\n{self.stdout}"
            f"\n--- stderr ---\n{self.stderr}"
        )

    def checksums(self, pattern: str) -> dict[int, str]:
        """rank -> the checksum it printed after ``pattern`` (group: rank). Not anchored to
        lines: mpiexec forwards each rank's output as it comes, and one rank's line can land in
        the middle of another's."""
        found = {
            int(m.group(1)): m.group(2)
            for m in re.finditer(pattern + r"parameter checksum (-?\d+\.\d{10})", self.stdout)
        }
        assert sorted(found) == list(range(RANKS)), self.output()
        return found

    def said(self, pattern: str) -> re.Match[str]:
        """The one line (stdout, anchored) matching ``pattern``."""
        found = list(re.finditer(pattern, self.stdout, re.M))
        assert len(found) == 1, f"expected one line matching {pattern!r}\n{self.output()}"
        return found[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory as a fresh clone gives a user: ``examples/`` in it."""
    where = tmp_path_factory.mktemp("user")
    (where / "examples").symlink_to(EXAMPLES)
    return where


Run = Callable[[str], Ran]


@pytest.fixture(scope="module")
def run(harness: ModuleType, workdir: Path) -> Run:
    def run(command: str) -> Ran:
        done = harness.run_as_typed(command, workdir, TIMEOUT_S)
        ran = Ran(command, done.returncode, done.stdout, done.stderr, workdir)
        assert ran.code == 0, ran.output()
        return ran

    return run


def _same_weights(ran: Ran) -> None:
    assert re.search(rf"\b{RANKS} ranks, the same weights on every rank", ran.stdout), ran.output()


def _started_once(ran: Ran) -> None:
    """rank 0's start-up line, shown by default, once; no one-rank hint under a launcher."""
    assert len(re.findall(rf"commlayer started: {RANKS} ranks on", ran.stderr)) == 1, ran.output()
    assert "runs over 1 rank" not in ran.stderr, ran.output()


# -- the checks, one for each documented command ---------------------------------------------------
def minimal(ran: Ran) -> None:
    sums = ran.checksums(rf"rank (\d) of {RANKS}: ")
    assert len(set(sums.values())) == 1, ran.output()
    _same_weights(ran)
    losses = [float(ran.said(rf"^epoch {e}: loss (\d\.\d{{4}})$")[1]) for e in range(3)]
    assert losses[0] > losses[1] > losses[2], ran.output()  # the docstring: it falls


def minimal_mpi(ran: Ran) -> None:
    minimal(ran)
    _started_once(ran)


def mnist_like(ran: Ran) -> None:
    # 1024 samples: 16 steps a rank and epoch, so the rate is warm by the end of epoch 0
    assert f"{RANKS} ranks, learning rate 0.02 x {RANKS} = 0.04 after 10 warm-up steps" in (
        ran.stdout
    ), ran.output()
    epochs = re.findall(
        rf"^epoch (\d): lr (\d\.\d+), train loss \d+\.\d+, test loss \d+\.\d+, test accuracy "
        rf"(\d+\.\d+)% \(averaged over {RANKS} ranks\)$",
        ran.stdout,
        re.M,
    )
    assert [e[0] for e in epochs] == ["0", "1"], ran.output()  # printed once: by rank 0
    assert all(float(e[1]) == pytest.approx(0.04) for e in epochs), ran.output()  # warmed up
    assert float(epochs[-1][2]) > 30.0, ran.output()  # 10 classes: chance is 10%


def checkpoint_first(ran: Ran) -> None:
    for rank in range(RANKS):
        assert f"rank {rank}: starting at epoch 0" in ran.stdout, ran.output()
    saved = re.findall(r"rank (\d): saved epoch (\d) to ckpt/checkpoint.pt", ran.stdout)
    assert saved == [("0", "1"), ("0", "2")], ran.output()
    assert sorted(p.name for p in (ran.cwd / "ckpt").iterdir()) == ["checkpoint.pt"]
    state = torch.load(ran.cwd / "ckpt" / "checkpoint.pt")
    assert state["epoch"] == 2 and set(state) == {"model", "optimizer", "epoch"}
    assert len(set(ran.checksums(r"rank (\d): ").values())) == 1, ran.output()
    _same_weights(ran)


def checkpoint_resumed(ran: Ran) -> None:
    for rank in range(RANKS):
        assert f"rank {rank}: starting at epoch 2" in ran.stdout, ran.output()
    saved = re.findall(r"rank (\d): saved epoch (\d) to ckpt/checkpoint.pt", ran.stdout)
    assert saved == [("0", "3"), ("0", "4")], ran.output()
    assert torch.load(ran.cwd / "ckpt" / "checkpoint.pt")["epoch"] == 4
    _same_weights(ran)


def _compression(ran: Ran, spec: str, at_most: float) -> None:
    rows = {}
    for name in ("none", spec):
        found = ran.said(
            rf"^{re.escape(name)}: ([\d,]+) bytes reduced a step.*; test loss (\d\.\d+) -> "
            rf"(\d\.\d+); the same weights on {RANKS} ranks$"
        )
        rows[name] = (int(found[1].replace(",", "")), float(found[2]), float(found[3]))
    (dense, first, last), (compressed, c_first, c_last) = rows["none"], rows[spec]
    assert 0 < compressed <= at_most * dense, ran.output()
    assert last < first and c_last < c_first, ran.output()  # both trained


def compression_fp16(ran: Ran) -> None:
    _compression(ran, "fp16", 0.55)  # half the bytes


def compression_from_the_environment(ran: Ran) -> None:
    # COMMLAYER_COMPRESSION, not the script's default (fp16, 0.5x): top-k 1% is far fewer bytes
    _compression(ran, "topk:ratio=0.01", 0.2)


def _ddp_hook(ran: Ran, spec: str) -> None:
    sums = ran.checksums(rf"rank (\d) of {RANKS}: {re.escape(spec)} hook, ")
    assert len(set(sums.values())) == 1, ran.output()
    found = ran.said(
        rf"^{re.escape(spec)} hook, \d+ steps: test loss (\d\.\d+) -> (\d\.\d+); {RANKS} ranks, "
        "the same weights on every rank$"
    )
    assert float(found[2]) < 0.5 * float(found[1]), ran.output()  # it learns (it rose before)


def ddp_hook_torchrun(ran: Ran) -> None:
    _ddp_hook(ran, "fp16")


def ddp_hook_mpi(ran: Ran) -> None:
    _ddp_hook(ran, "topk:ratio=0.1")


def lightning_trainer(ran: Ran) -> None:
    # 512 samples, batches of 32: 8 a rank and epoch from its half (DistributedSampler), 16 alone
    sums = ran.checksums(rf"rank (\d) of {RANKS}: 8 batches an epoch, ")
    # different first weights on each rank: the same end only if rank 0's were broadcast and
    # every step's gradients averaged
    assert len(set(sums.values())) == 1, ran.output()
    found = ran.said(r"^2 epochs: train_loss \d\.\d+ .* accuracy on the whole set (\d+\.\d)%; ")
    assert float(found[1]) > 65.0, ran.output()  # two classes: chance is 50%
    _same_weights(ran)


def _model_parallel(strategy: str, ranks: int) -> Callable[[Ran], None]:
    def check(ran: Ran) -> None:
        found = ran.said(
            rf"^{re.escape(strategy)} parallelism on {ranks} ranks: \d+\.\d ms a step .*; every "
            r"step's loss within (\S+) of one process's training \(float64\)$"
        )
        assert float(found[1]) <= 1e-9, ran.output()

    return check


# Every command of every example's docstring, verbatim, and what checks it did what it says.
CHECKS: dict[str, Callable[[Ran], None]] = {
    "commlayerrun -np 2 python examples/minimal.py": minimal_mpi,
    "torchrun --standalone --nproc_per_node 2 examples/minimal.py": minimal,
    "commlayerrun -np 2 python examples/mnist_like.py --epochs 2 --train-size 1024 "
    "--warmup-steps 10": mnist_like,
    "commlayerrun -np 2 python examples/checkpoint.py --dir ckpt --epochs 2": checkpoint_first,
    "commlayerrun -np 2 python examples/checkpoint.py --dir ckpt --epochs 4   # resumes at 2": (
        checkpoint_resumed
    ),
    "commlayerrun -np 2 python examples/compression.py --compression fp16": compression_fp16,
    'COMMLAYER_COMPRESSION="topk:ratio=0.01" commlayerrun -np 2 python examples/compression.py': (
        compression_from_the_environment
    ),
    "torchrun --standalone --nproc_per_node 2 examples/ddp_hook.py --compression fp16": (
        ddp_hook_torchrun
    ),
    "commlayerrun -np 2 python examples/ddp_hook.py --compression topk:ratio=0.1": ddp_hook_mpi,
    "commlayerrun -np 2 python examples/lightning_trainer.py": lightning_trainer,
    "torchrun --standalone --nproc_per_node 2 examples/lightning_trainer.py": lightning_trainer,
    "commlayerrun -np 2 python examples/model_parallel_cnn.py --strategy filter --check": (
        _model_parallel("filter", 2)
    ),
    "commlayerrun -np 4 python examples/model_parallel_cnn.py --strategy data+filter "
    "--model-ways 2 --check": _model_parallel("data+filter", 4),
    "commlayerrun -np 3 python examples/model_parallel_cnn.py --strategy pipeline "
    "--micro-batches 8 --check": _model_parallel("pipeline", 3),
}
# Run by another test, which asserts the command is the docstring's.
ELSEWHERE = {
    "commlayerrun -np 2 python examples/train_digits.py --epochs 3   # the demo runs 15": (
        "test_launcher_demo.py"
    ),
}


def test_every_docstring_command_is_checked(harness: ModuleType) -> None:
    commands = {p.name: harness.docstring_commands(p) for p in sorted(EXAMPLES.glob("*.py"))}
    assert all(commands.values()), commands  # every example says how to run it
    documented = [c for found in commands.values() for c in found]
    assert len(documented) == len(set(documented))
    assert set(documented) == set(CHECKS) | set(ELSEWHERE)


@pytest.mark.parametrize("command", list(CHECKS))
def test_docstring_command_does_what_it_says(
    harness: ModuleType, run: Run, workdir: Path, command: str
) -> None:
    if "lightning" in command:
        pytest.importorskip("lightning.pytorch")
    if CHECKS[command] is checkpoint_resumed and not (workdir / "ckpt").exists():
        run(next(c for c, check in CHECKS.items() if check is checkpoint_first))  # run alone
    ran = run(command)
    CHECKS[command](ran)
    # what the documentation shows it printing (<!-- output of: COMMAND -->), it prints
    assert harness.documented_output_mismatches(command, ran.stdout) == [], ran.output()
