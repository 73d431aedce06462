"""The exchange plan of partial-local shuffling (commlayer/data/plan.py), for every rank of many
jobs at once: applying every rank's plan moves each sample to exactly one rank, keeps every
shard's size, sends round(Q * shard) samples per rank (those dealt to their own rank stay), and
every receiver's expected counts match what its senders' plans send it."""

from __future__ import annotations

import pytest

from commlayer.data.plan import make_plan, send_counts


def _shards(sizes: list[int]) -> list[list[int]]:
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    return [list(range(s, s + n)) for s, n in zip(starts, sizes)]


@pytest.mark.parametrize("sizes", [[5], [4, 4], [7, 6, 6], [3, 9, 1, 5], [10, 10, 10, 10, 9]])
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("chunks", [1, 3])
def test_plans_of_all_ranks_move_each_sample_once(
    sizes: list[int], fraction: float, chunks: int
) -> None:
    shards = _shards(sizes)
    for epoch in range(3):
        plans = [
            make_plan(7, epoch, fraction, r, shards[r], sizes, chunks) for r in range(len(sizes))
        ]
        moved_to = {i: d for p in plans for chunk in p.sends for i, d in chunk}
        new = [[i for i in shard if i not in moved_to] for shard in shards]
        for i, dest in moved_to.items():
            new[dest].append(i)
        assert sorted(i for shard in new for i in shard) == list(range(sum(sizes)))
        assert [len(s) for s in new] == sizes
        for r, plan in enumerate(plans):
            assert len(plan.sends) == chunks
            assert len(plan.sent_ids) <= send_counts(fraction, sizes)[r]
            assert all(d != r for chunk in plan.sends for _, d in chunk)
            got = [
                sum(1 for c in plans[q].sends for _, d in c if d == r) for q in range(len(sizes))
            ]
            assert list(plan.receives_from) == got
        shards = new


def test_plan_depends_on_seed_and_epoch_only() -> None:
    sizes = [20, 20, 20]
    shards = _shards(sizes)
    first = make_plan(1, 0, 0.5, 1, shards[1], sizes, 2)
    assert first == make_plan(1, 0, 0.5, 1, list(reversed(shards[1])), sizes, 2)
    assert first != make_plan(2, 0, 0.5, 1, shards[1], sizes, 2)
    assert first != make_plan(1, 1, 0.5, 1, shards[1], sizes, 2)


def test_the_oldest_groups_are_sent_first_in_a_random_order_within() -> None:
    # A pack store's samples by age (packs.py): a fraction of 0.5 of 40 samples in packs of 8
    # sends the first two packs whole and 4 of the third, chosen at random; one group is the
    # plan without groups.
    sizes = [40, 40]
    shards = _shards(sizes)
    groups = [shards[1][k : k + 8] for k in range(0, 40, 8)]
    slots = []
    for epoch in range(4):
        plan = make_plan(3, epoch, 0.5, 1, shards[1], sizes, 2, groups)
        ungrouped = make_plan(3, epoch, 0.5, 1, shards[1], sizes, 2)
        assert make_plan(3, epoch, 0.5, 1, shards[1], sizes, 2, [shards[1]]) == ungrouped
        # slots dealt to rank 1 itself stay: they count among the 20 picked, not in sends
        sent = set(plan.sent_ids)
        assert sent <= set(groups[0] + groups[1] + groups[2])
        slots.append(frozenset(sent & set(groups[2])))
    assert len(set(slots)) > 1, "the samples taken from the third pack vary by epoch"
