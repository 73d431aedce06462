"""Pack files of the shard store (commlayer/data/packs.py), one process, no collective: records
read back as written, staging and taking in, compaction keeping every live record and removing
the superseded files, a stale copy (a persistent DataLoader worker) finding samples that a commit
or a compaction moved, and truncated or malformed files named."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from commlayer.data.packs import LayoutError, PackSet


def _save(packs: PackSet, meta: Path) -> None:
    """What ShardStore._save does with a pack set: persist, then the journal naming it."""
    packs.persist(ending=True)
    meta.write_text(json.dumps({"layout": {"packs": packs.state()}}))


def _sample(i: int) -> bytes:
    return bytes([i % 251]) * (100 + i % 7)


def _written(tmp_path: Path, n: int) -> tuple[PackSet, Path]:
    meta = tmp_path / "store.json"
    packs = PackSet(tmp_path, None, meta)
    packs.write_all((i, _sample(i)) for i in range(n))
    _save(packs, meta)
    return packs, meta


def test_records_read_back_and_exchange_in_two_phases(tmp_path: Path) -> None:
    packs, meta = _written(tmp_path, 50)
    assert sorted(packs.ids()) == list(range(50))
    assert all(packs.read(i) == _sample(i) for i in range(50))
    for i in range(100, 110):
        packs.stage(i, _sample(i))
    packs.persist(ending=False)  # the journal names the staging pack ("prepared")
    prepared = packs.state()
    assert prepared["staging"] is not None
    # a process reopening from that journal finds what was staged in the staging pack
    again = PackSet(tmp_path, prepared, meta)
    assert sorted(again.staged()) == list(range(100, 110))
    for i in range(10):
        again.remove(i)
    for i in range(100, 110):
        again.take(i)
    _save(again, meta)
    again.drop_staged()
    reopened = PackSet(tmp_path, json.loads(meta.read_text())["layout"]["packs"], meta)
    assert sorted(reopened.ids()) == list(range(10, 50)) + list(range(100, 110))
    assert all(reopened.read(i) == _sample(i) for i in reopened.ids())
    assert reopened.stray_files() == []


def test_compaction_keeps_every_live_record_and_a_stale_copy_rereads(tmp_path: Path) -> None:
    packs, meta = _written(tmp_path, 200)
    stale = pickle.loads(pickle.dumps(packs))  # a spawned DataLoader worker's copy
    for i in range(0, 200, 3):  # a third sent away: well past the overhead budget
        packs.remove(i)
    _save(packs, meta)
    assert packs.compact()
    _save(packs, meta)
    packs.drop_superseded()
    live = [i for i in range(200) if i % 3]
    assert sorted(packs.ids()) == live
    assert all(packs.read(i) == _sample(i) for i in live)
    assert not (tmp_path / "packs" / "1.pack").exists(), "the compacted pack is removed"
    assert packs.stray_files() == []
    assert not packs.compact(), "nothing left to compact"
    # the stale copy's index points into the removed pack: it rereads the journal's index
    assert all(stale.read(i) == _sample(i) for i in live)
    with pytest.raises(LayoutError, match="sample 0 is not in this rank's store"):
        stale.read(0)


def test_a_stale_copy_whose_journal_index_is_superseded_meanwhile_reads_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A persistent DataLoader worker read the journal naming index N, and before it read that
    # index the writer saved N + 1 and removed N (found by a 4-rank run: "cannot read the index
    # .../index-4.bin"): it reads the journal again and takes the newer index.
    packs, meta = _written(tmp_path, 60)
    stale = pickle.loads(pickle.dumps(packs))
    for i in range(0, 60, 2):
        packs.remove(i)
    _save(packs, meta)
    older = json.loads(meta.read_text())
    assert packs.compact()
    _save(packs, meta)
    packs.drop_superseded()
    newer = meta.read_text()
    assert not (tmp_path / f"index-{older['layout']['packs']['index']}.bin").exists()
    reads = []
    real_read_text = Path.read_text

    def journal_then_newer(path: Path, *args: object, **kwargs: object) -> str:
        if path != meta:
            return real_read_text(path, *args, **kwargs)  # type: ignore[arg-type]
        reads.append(path)
        return json.dumps(older) if len(reads) == 1 else newer  # the first read is stale

    monkeypatch.setattr(Path, "read_text", journal_then_newer)
    assert stale.read(1) == _sample(1)  # 1 was in the removed pack: it rereads
    assert len(reads) == 2, "the journal was read again after its index had gone"


def test_truncated_and_malformed_files_are_named(tmp_path: Path) -> None:
    packs, meta = _written(tmp_path, 20)
    state = packs.state()
    index = tmp_path / f"index-{state['index']}.bin"
    pack = tmp_path / "packs" / "1.pack"
    os.truncate(pack, pack.stat().st_size - 1)
    with pytest.raises(LayoutError, match=rf"the pack '{pack}' is truncated"):
        PackSet(tmp_path, state, meta)
    data = index.read_bytes()
    index.write_bytes(data[:-5])
    with pytest.raises(LayoutError, match=rf"the index '{index}' is truncated or malformed"):
        PackSet(tmp_path, state, meta)
    index.write_bytes(b"garbage!" + data[8:])
    with pytest.raises(LayoutError, match=rf"'{index}' is not a pack index"):
        PackSet(tmp_path, state, meta)
    # a staging pack cut short mid-record (the forward recovery reads it back)
    staging = PackSet(tmp_path / "s", None, tmp_path / "s.json")
    staging.stage(1, b"x" * 50)
    staging.persist(ending=False)
    cut = staging.pack_file(staging.state()["staging"])
    os.truncate(cut, cut.stat().st_size - 10)
    reopened = PackSet(tmp_path / "s", staging.state(), tmp_path / "s.json")
    with pytest.raises(
        LayoutError, match=rf"the pack '{cut}' is truncated: the record of sample 1"
    ):
        reopened.staged()


def test_an_array_store_written_before_pack_files_keeps_its_received_samples(
    tmp_path: Path,
) -> None:
    # <file>.store/samples/<id>.pkl (received samples before pack files) are taken into a pack
    # when the store is opened: none is lost.
    import numpy as np

    from commlayer.data.layouts import ArrayFile, encode

    file = tmp_path / "shard0.npy"
    np.save(file, np.arange(8, dtype=np.float32).reshape(4, 2))
    old = tmp_path / "shard0.npy.store" / "samples"
    old.mkdir(parents=True)
    (old / "100.pkl").write_bytes(encode(("received", 100)))
    layout = ArrayFile(file, {"first_id": 0, "removed": [1]})
    assert sorted(layout.ids()) == [0, 2, 3, 100]
    assert layout.load(100) == ("received", 100)
    assert layout.state()["packs"]["index"] == 1, "the next save names the new pack's index"


def test_a_read_racing_a_compaction_finds_the_sample_in_the_new_pack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The training thread looks a sample up in the old index; before it opens the old pack, the
    # I/O thread compacts, saves and removes that pack: the read uses the new index.
    packs, meta = _written(tmp_path, 60)
    for i in range(0, 60, 2):
        packs.remove(i)
    _save(packs, meta)
    fresh = PackSet(tmp_path, json.loads(meta.read_text())["layout"]["packs"], meta)
    record, raced = PackSet._record, []

    def racing(self: PackSet, *args: int) -> bytes:
        if not raced:
            raced.append(args[1])  # the pack the old index names
            assert self.compact()
            _save(self, meta)
            self.drop_superseded()
            self._close_fds(keep={p for p, _, _ in self.index.values()})
        return record(self, *args)

    monkeypatch.setattr(PackSet, "_record", racing)
    assert fresh.read(1) == _sample(1)
    assert raced == [1] and fresh.index[1][0] != 1, "read from the compaction's new pack"
    assert not fresh.pack_file(1).exists()


def test_packs_and_index_of_the_old_format_are_read_and_compacted_into_the_new(
    tmp_path: Path,
) -> None:
    # CLPACK1 packs (12-byte record headers) and a CLINDEX1 index, as written before the
    # compact format: read as they are; a compaction copies their live records into a CLPACK2
    # pack, and the next save writes a CLINDEX2 index.
    import struct

    import numpy as np

    from commlayer.data.packs import ENTRY_V1, PACK_MAGIC, PACK_MAGIC_V1

    (tmp_path / "packs").mkdir()
    body, entries = bytearray(PACK_MAGIC_V1), []
    for i in range(30):
        entries.append((i, 1, len(body), len(_sample(i))))
        body += struct.pack("<qI", i, len(_sample(i))) + _sample(i)
    (tmp_path / "packs" / "1.pack").write_bytes(bytes(body))
    index = np.array(entries, dtype=ENTRY_V1)
    (tmp_path / "index-1.bin").write_bytes(b"CLINDEX1" + struct.pack("<Q", 30) + index.tobytes())
    meta = tmp_path / "store.json"
    packs = PackSet(tmp_path, {"index": 1, "next": 2, "staging": None}, meta)
    assert all(packs.read(i) == _sample(i) for i in range(30))
    assert packs.groups() == [list(range(30))]
    for i in range(20):
        packs.remove(i)
    assert packs.compact()
    _save(packs, meta)
    packs.drop_superseded()
    reopened = PackSet(tmp_path, json.loads(meta.read_text())["layout"]["packs"], meta)
    assert sorted(reopened.ids()) == list(range(20, 30))
    assert all(reopened.read(i) == _sample(i) for i in range(20, 30))
    assert reopened.pack_file(2).read_bytes()[:8] == PACK_MAGIC
    assert reopened.index_file(reopened.gen).read_bytes()[:8] == b"CLINDEX2"
    assert not (tmp_path / "packs" / "1.pack").exists()


def test_packs_die_whole_oldest_first_and_compaction_copies_one_pack(tmp_path: Path) -> None:
    # 4 packs of 40 samples: groups() gives them oldest first. The samples of the first one
    # and a half packs sent away (what the plan sends first): the first pack is unlinked at
    # the save without a copy; the store is then past its overhead budget, and the half-live
    # pack is the only one a compaction copies, its copy keeping its place in the age order.
    meta = tmp_path / "store.json"
    packs = PackSet(tmp_path, None, meta)

    def sample(i: int) -> bytes:
        return bytes([i % 251]) * 100

    size = 100 + 3  # the most a record takes here (its header: 2 varints)
    # a pack closes once it holds this much: 40 records of ids 0..39 (1-byte varints) and 8
    # bytes of magic; 40 of the later ids (1 or 2-byte varints) too
    packs.write_all(((i, sample(i)) for i in range(160)), pack_bytes=8 + 40 * 102)
    _save(packs, meta)
    groups = packs.groups()
    assert [len(g) for g in groups] == [40] * 4 and groups[0] == list(range(40))
    for i in range(64):  # pack 1 all, pack 2 in part
        packs.remove(i)
    _save(packs, meta)
    packs.drop_staged()  # what the commit's end does
    assert not packs.pack_file(1).exists() and packs.copied == 0
    assert packs.compact(), "24 of pack 2's 40 records dead: past the 8% budget"
    assert 0 < packs.copied <= 16 * size, packs.copied  # its 16 live records only
    _save(packs, meta)
    packs.drop_superseded()
    groups = packs.groups()
    assert groups[0] == list(range(64, 80)) and len(groups) == 3
    assert all(packs.read(i) == sample(i) for i in range(64, 160))
    assert not packs.compact(), "nothing more is due"
