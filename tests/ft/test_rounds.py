"""What 'exact' keeps to replace a group (``shoal.ft.rounds``), without processes: the
hand-over's numbers summed over groups say what each group said, the cadence of
hand-overs, and a round handed to a replacement."""

from __future__ import annotations

import torch

from shoal.ft.rounds import Rounds, serialized


def test_the_hand_overs_numbers_summed_over_the_groups_say_each_groups_part():
    groups = 3
    blobs = [b"x" * 5, b"", b"y" * (3 * 2**20 + 7)]  # the last: longer than one SPLIT
    parts = []
    for group, blob in enumerate(blobs):
        rounds = Rounds()
        rounds.pending, rounds.blob = ({} if blob else None), blob
        parts.append(torch.tensor(rounds.numbers(True, group == 1, group, groups)))
    summed = torch.stack(parts).sum(0)  # float32, as the step's numbers go
    reader = Rounds()
    reader.read(summed.tolist(), groups, exact=True)
    assert reader.brought == 3 and reader.handing and reader.next
    assert reader.lengths == [len(b) for b in blobs]
    reader.read(summed.tolist(), groups, exact=False)  # a precision that loses lengths
    assert reader.lengths is None


def test_a_group_that_does_not_bring_its_step_says_so():
    rounds = Rounds()
    rounds.pending, rounds.blob = {}, b"abc"
    summed = (torch.tensor(rounds.numbers(False, True, 0, 2))
              + torch.tensor(Rounds().numbers(True, False, 1, 2)))
    rounds.read(summed.tolist(), 2, exact=True)
    assert rounds.brought == 1 and not rounds.handing and not rounds.next
    assert rounds.lengths is None  # read only in a step whose groups hand over


def _kept(rounds: Rounds, step: int) -> None:
    rows = (torch.zeros(2, 100, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64))
    rounds.keep({"global_step": step, "w": torch.zeros(1000)}, rows, [])


def test_hand_overs_come_every_so_many_steps_and_no_more_than_their_share():
    every = Rounds(every=10, share=1.0)
    assert not every.due(5)  # no round yet
    _kept(every, 0)
    assert not every.due(9) and every.due(10)
    every.pending = {}  # a hand-over under way
    assert not every.due(10)

    rare = Rounds(every=10, share=0.01)
    _kept(rare, 0)
    rare.cost = 10.0  # a hand-over took 10 s: the next after 1000 s ...
    assert not rare.due(50)
    for _ in range(3):  # ... unless the log holds as many bytes as the round
        rare.log_step(torch.zeros(1000), (0.0, 1))
    assert not rare.due(9) and rare.due(10)

    # A group of several processes: every ``every`` steps exactly, whatever a process's
    # clock and log say (its processes must hand over at the same step).
    counted = Rounds(every=10, share=0.01, counted=True)
    _kept(counted, 0)
    counted.cost = 10.0
    assert not counted.due(9) and counted.due(10)


def test_a_replacement_loads_its_own_groups_private_state_and_redoes_the_log():
    private = [{"comm": {"residual": torch.full((3,), float(g))}} for g in range(2)]
    blobs = [serialized(p) for p in private]
    longest = max(len(b) for b in blobs)
    rows = torch.zeros(2, longest, dtype=torch.uint8)
    for g, blob in enumerate(blobs):
        rows[g, :len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    lengths = torch.tensor([len(b) for b in blobs])
    live = Rounds()
    live.keep({"global_step": 4, "model": torch.ones(2)}, (rows, lengths), [])
    for step in range(3):
        live.log_step(torch.full((2,), float(step)), (float(step), 2))
    replacement = Rounds()
    replacement.hand_next = True
    loaded = replacement.received(live.sent(), group=1)
    assert loaded["global_step"] == 4 and torch.equal(loaded["model"], torch.ones(2))
    assert torch.equal(loaded["comm"]["residual"], torch.full((3,), 1.0))
    assert [losses for _, losses in replacement.replay] == [(0.0, 2), (1.0, 2), (2.0, 2)]
    assert replacement.log == replacement.replay and replacement.log is not replacement.replay
    assert not replacement.hand_next


def test_a_hand_over_becomes_the_round_only_if_its_step_commits():
    rounds = Rounds()
    _kept(rounds, 0)
    rows = (torch.ones(2, 4, dtype=torch.uint8), torch.tensor([4, 4]))
    rounds.log_step(torch.zeros(3), (0.0, 1))
    rounds.pending, rounds.gathered = {"global_step": 7}, rows
    rounds.end_hand_over(committed=False)
    assert rounds.state is not None and rounds.state["global_step"] == 0
    assert rounds.pending is None and rounds.gathered is None and len(rounds.log) == 1
    rounds.pending, rounds.gathered = {"global_step": 7}, rows
    rounds.end_hand_over(committed=True)
    assert rounds.state == {"global_step": 7} and rounds.rows is rows and rounds.log == []
