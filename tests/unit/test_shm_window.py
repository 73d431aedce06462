"""backends/shm.py's FileWindow (the torch backend's shared memory) in one process: its files
are gone once mapped, a rank that cannot make its file makes every rank raise (``agree``), and
the memory is shared between two mappings of the same files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from commlayer.backends import shm


def test_two_ranks_map_the_same_memory_and_leave_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm.FileWindow, "DIRECTORY", str(tmp_path))
    votes: list[bool] = []

    def agree(ok: bool) -> bool:
        votes.append(ok)
        return ok

    # rank 1's file first (what rank 1 would make), then rank 0 maps both
    (tmp_path / "commlayer-t-1").write_bytes(b"\0" * 4096)
    window = shm.FileWindow(0, 2, "t", 4096, agree)
    other = np.memmap(tmp_path / "commlayer-t-1", dtype=np.uint8, mode="r+")
    window.segments[1][:3] = [7, 8, 9]
    assert other[:3].tolist() == [7, 8, 9]
    assert votes == [True, True]
    assert not (tmp_path / "commlayer-t-0").exists()  # unlinked once every rank mapped it
    window.close()


def test_a_rank_that_cannot_make_its_file_fails_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm.FileWindow, "DIRECTORY", str(tmp_path / "missing"))
    votes: list[bool] = []

    def agree(ok: bool) -> bool:
        votes.append(ok)
        return False if not ok else ok

    with pytest.raises(OSError, match=r"rank 1: no shared-memory window of 2 x 4096 B"):
        shm.FileWindow(1, 2, "t", 4096, agree)
    assert votes == [False]  # it told the others before raising, so none waits for it


def test_a_rank_whose_peer_failed_raises_and_removes_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm.FileWindow, "DIRECTORY", str(tmp_path))
    with pytest.raises(OSError, match="another rank could not make its file"):
        shm.FileWindow(0, 2, "t", 4096, lambda ok: False)
    assert list(tmp_path.iterdir()) == []
