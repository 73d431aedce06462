"""The elastic driver's policy, without processes (commlayer/launch/driver.py, issue 48): the
ranks of a new world (Horovod's get_host_assignments, survivors kept and first), the blacklist's
cooldown (Horovod's exponential backoff), and host discovery that fails or hangs."""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import pytest

from commlayer.launch import driver
from commlayer.launch.driver import Blacklist, Slot, assign


def _free(host: str, slot: int) -> bool:
    return True


def _places(world: list[Slot]) -> list[tuple[str, int]]:
    return [(s.host, s.slot) for s in world]


def test_assign_is_horovods_host_order_with_local_and_cross_ranks() -> None:
    world = assign(["a", "b"], {"a": 2, "b": 3}, _free, {}, max_np=10)
    assert _places(world) == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2)]
    assert [s.rank for s in world] == [0, 1, 2, 3, 4] and {s.size for s in world} == {5}
    assert [(s.local_rank, s.local_size) for s in world] == [(0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    # cross: among the hosts' workers of the same local rank
    assert [(s.cross_rank, s.cross_size) for s in world] == [(0, 2), (0, 2), (1, 2), (1, 2), (0, 1)]
    assert world[3].environ() == {
        "HOROVOD_HOSTNAME": "b",
        "HOROVOD_RANK": "3",
        "HOROVOD_SIZE": "5",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "3",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_CROSS_SIZE": "2",
    }


def test_assign_caps_at_max_np_in_host_order() -> None:
    assert _places(assign(["a", "b"], {"a": 2, "b": 2}, _free, {}, max_np=3)) == [
        ("a", 0),
        ("a", 1),
        ("b", 0),
    ]


def test_assign_skips_blacklisted_slots_and_unknown_hosts() -> None:
    world = assign(["a", "b"], {"b": 2}, lambda h, s: (h, s) != ("b", 0), {}, max_np=4)
    assert _places(world) == [("b", 1)]


def test_survivors_keep_their_places_first_and_are_never_dropped_for_new_slots() -> None:
    # Horovod's test_single_rank_failure: host a out, b's workers (ranks 2, 3) carry on
    kept = {("b", 0): 2, ("b", 1): 3}
    world = assign(["b"], {"a": 2, "b": 2}, _free, kept, max_np=4)
    assert _places(world) == [("b", 0), ("b", 1)]
    # hosts added: the survivors keep ranks 0, 1 and the new host's slots come after
    world = assign(["a", "b"], {"a": 2, "b": 2}, _free, {("a", 0): 0, ("a", 1): 1}, max_np=4)
    assert _places(world) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    # at max_np, a survivor on a later host stays; a new slot on an earlier host does not start
    world = assign(["a", "b"], {"a": 4, "b": 1}, _free, {("a", 0): 0, ("b", 0): 1}, max_np=2)
    assert _places(world) == [("a", 0), ("b", 0)]


def test_rank_0_holds_the_last_commit_when_any_worker_does() -> None:
    # slot scope: a's slot 0 came back from the blacklist with a new worker; a's slot 1 kept
    world = assign(["a"], {"a": 2}, _free, {("a", 1): 0}, max_np=2)
    assert _places(world) == [("a", 1), ("a", 0)] and world[0].rank == 0
    # a host with survivors goes before one in front of it that has none
    world = assign(["a", "b"], {"a": 1, "b": 1}, _free, {("b", 0): 0}, max_np=2)
    assert _places(world) == [("b", 0), ("a", 0)]


def test_cooldown_is_horovods_exponential_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(driver.random, "uniform", lambda lo, hi: 0.5)
    hosts = Blacklist((10.0, 100.0), "host")
    assert hosts.add("a", 0, now=0.0) == pytest.approx(25.0)  # 10 * 2**1 + 0.5 * 10
    assert hosts.blocked("a", 1, 24.0) and not hosts.blocked("a", 1, 25.0)
    assert hosts.add("a", 0, now=5.0) == pytest.approx(20.0)  # cooling down: the end stands
    assert hosts.add("a", 0, now=30.0) == pytest.approx(45.0)  # 10 * 2**2 + 5
    assert hosts.add("a", 0, now=100.0) == pytest.approx(85.0)
    assert hosts.add("a", 0, now=200.0) == pytest.approx(100.0)  # clamped to HI
    assert Blacklist((1.0, 2.0), "host").add("b", 0, 0.0) == pytest.approx(2.0)  # Horovod's test


def test_without_a_range_a_host_stays_out_and_scope_slot_blames_one_slot() -> None:
    hosts = Blacklist(None, "host")
    assert math.isinf(hosts.add("a", 1, 0.0))
    assert hosts.blocked("a", 0, 1e9) and hosts.host_blocked("a", 1e9)
    slots = Blacklist(None, "slot")
    slots.add("a", 1, 0.0)
    assert slots.blocked("a", 1, 5.0) and not slots.blocked("a", 0, 5.0)
    assert not slots.host_blocked("a", 5.0)
    with pytest.raises(ValueError, match="--blacklist-scope 'rack'"):
        Blacklist(None, "rack")


def test_back_reports_each_host_once_its_cooldown_ends() -> None:
    hosts = Blacklist((1.0, 1.0), "host")
    hosts.add("a", 0, 0.0)
    assert hosts.back(0.5) == [] and hosts.back(1.0) == ["a"] and hosts.back(2.0) == []
    assert not hosts.blocked("a", 0, 1.0)


def test_a_hanging_discovery_script_is_stopped_with_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(driver, "_DISCOVERY_TIMEOUT_S", 1.0)
    pid_file = tmp_path / "child"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {pid_file}\nwait\n")
    script.chmod(0o755)
    began = time.monotonic()
    with pytest.raises(ValueError, match="ran past 1 s; stopped"):
        driver.discovery_script(str(script), 1)()
    assert time.monotonic() - began < 10
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # killed: gone once its parent's init reaps it
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text()


def _job(discover: object, timeout_s: float) -> driver.Driver:
    return driver.Driver(
        ["true"], 1, 1, 1, discover, {}, elastic_timeout_s=timeout_s, hosts={"localhost": 1}
    )


def test_failing_discovery_keeps_the_last_hosts_then_fails_after_the_timeout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(driver, "_DISCOVERY_S", 0.05)
    runs = []

    def discover() -> dict[str, int]:
        runs.append(time.monotonic())
        if len(runs) == 1:
            return {"localhost": 2}
        raise ValueError("host discovery script x exited with 1: boom")

    job = _job(discover, timeout_s=1.0)
    thread = threading.Thread(target=job._discovery, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        with job._cv:
            while job._discovered is None and time.monotonic() < deadline:
                job._cv.wait(0.05)
            job._take_discovery(time.monotonic())
            assert job._hosts == {"localhost": 2}
            while not job._discovery_error and time.monotonic() < deadline:
                job._cv.wait(0.05)
            job._take_discovery(time.monotonic())  # failing, but within the timeout
            assert job._hosts == {"localhost": 2}
            with pytest.raises(driver.JobError, match="has not succeeded for more than"):
                while time.monotonic() < deadline:
                    job._take_discovery(time.monotonic())
                    job._cv.wait(0.05)
    finally:
        with job._cv:
            job._stopping = True
            job._cv.notify_all()
        thread.join(5)
        assert job._server is None  # no worker started: the server never listened
    # one line for the failing streak, and retries backing off (not one a tick)
    assert capsys.readouterr().err.count("keeping the last hosts and retrying") == 1
    gaps = [b - a for a, b in zip(runs[1:], runs[2:])]
    assert gaps and gaps[-1] > gaps[0], gaps


def test_the_driver_refuses_a_bad_policy() -> None:
    with pytest.raises(ValueError, match="--on-state-lost 'maybe'"):
        driver.Driver(["true"], 1, 1, 1, dict, {}, on_state_lost="maybe")
    with pytest.raises(ValueError, match="need 1 <= --min-np"):
        driver.Driver(["true"], 2, 3, 4, dict, {})
    assert os.environ.get("COMMLAYER_ELASTIC_KEY") is None


def test_notices_of_another_world_are_stale_and_host_changes_are_replayed_on_joining(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's side (elastic/rendezvous.py): a death notice counts for the world it names
    only, every death of that world is kept, and host changes the driver reported since the
    world formed reach a state that joins it later."""
    from commlayer.backends import torch_distributed
    from commlayer.elastic import rendezvous
    from commlayer.elastic.state import State

    reported: list[list[int]] = []
    monkeypatch.setattr(torch_distributed, "report_dead", lambda ranks: reported.append(ranks))
    for name, value in [("_generation", -1), ("_joined", True), ("_formed", 0.0),
                        ("_skip_sync_ok", False), ("_state_lost", False),
                        ("_broken_event", threading.Event()),
                        ("_dead_ranks", set()), ("_host_notices", [])]:  # fmt: skip
        monkeypatch.setattr(rendezvous, name, value)  # restored after the test
    rendezvous._enter({"timestamp": 100.0, "joined": False}, 3)
    rendezvous._dead(2, [1])  # a notice of world 2, late
    assert not rendezvous.world_broken(0.0) and reported == [[]]
    rendezvous._dead(3, [2])
    rendezvous._dead(3, [0])
    assert rendezvous.world_broken() and reported[-1] == [0, 2]
    # a change reported before a state joined (the notices' thread keeps it)
    with rendezvous._lock:
        rendezvous._host_notices.append((105.0, False))
    state = State()
    rendezvous.join(state)
    assert state._last_updated_timestamp == 100.0
    assert state._host_messages.get_nowait() == (105.0, False)
    # entering the next world keeps only what is newer than its formation
    rendezvous._enter({"timestamp": 110.0}, 4)
    assert rendezvous._host_notices == [] and not rendezvous.world_broken(0.0)
    # a report that comes while a failed set-up waits for it
    threading.Timer(0.2, rendezvous._dead, (4, [1])).start()
    assert rendezvous.world_broken(5.0)
