"""What 'exact' keeps to replace a group whose ranks hold a state of their own, which no
live group holds: the error feedback of powersgd and topk, the inner optimizer of local_sgd
and diloco.

A round is this group's state at a hand-over (powersgd, topk: every few steps) or a meeting
(local_sgd, diloco), every group's private state gathered with it, and the log of the steps
since: each step's mean (under topk in DDP's hook, the groups' selections it was made of)
with its losses of every group. A replacement loads the round with its own group's private
state and redoes the logged steps alone (``replay``). The groups agree on a hand-over
through each step's numbers (``numbers``, ``read``).
"""

from __future__ import annotations

import io
import time
from typing import TYPE_CHECKING

import torch

from shoal.ft.step import SPLIT, state_bytes

if TYPE_CHECKING:
    from shoal.ft.engine import Replica

Logged = tuple[torch.Tensor | tuple[torch.Tensor, int], tuple[float, int]]
"""A step's mean (or the selections it was made of, with the groups' number) and its losses
of every group."""


class Rounds:
    """The last round of this group, its log, and when the next hand-over is due."""

    def __init__(self, every: int = 1, share: float = 1.0, counted: bool = False):
        """``every``, ``share``: ``compression_state_every`` and ``_share`` (see ``due``);
        ``counted``: a group of several processes, which hands over every ``every`` steps
        exactly (each process's clock and log would say "due" at a step of its own, and
        the processes of a group must hand over at the same step)."""
        self.every, self.share, self.counted = every, share, counted
        self.state: dict | None = None
        """This group's state at the last round (None: no round yet)."""
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None
        """Every group's private state at that round: serialized rows, and their lengths."""
        self.log: list[Logged] = []
        self.replay: list[Logged] = []
        """The logged steps a replacement redoes alone, first first."""
        self.pending: dict | None = None  # the state a hand-over keeps if its step commits
        self.gathered: tuple[torch.Tensor, torch.Tensor] | None = None  # and every group's
        self.blob = b""  # this rank's private state, serialized, for that hand-over
        self.cost = 0.0  # the seconds a hand-over took this process (see ``due``)
        self.hand_next = False  # the last step committed, and its numbers said: hand over
        # What the step's numbers said (``read``): the groups that brought their step,
        # whether they hand over in it and in the next, and each group's blob length (None:
        # sent in a precision that does not hold them exactly; then gathered with the blobs).
        self.brought, self.handing, self.next = 0, False, False
        self.lengths: list[int] | None = None
        self._at = 0.0  # when the last round was kept
        self._log_bytes = self._state_bytes = 0  # the log's, against the round's

    def keep(self, state: dict, rows: tuple[torch.Tensor, torch.Tensor],
             log: list[Logged]) -> None:
        """A round's state, every group's private state with it and the log since (the
        cadence, ``due``, counts from now)."""
        self.state, self.rows, self.log = state, rows, log
        self._at = time.monotonic()
        self._log_bytes = sum(_bytes(mean) for mean, _ in log)
        self._state_bytes = state_bytes(state) + rows[0].numel()

    def end_hand_over(self, committed: bool) -> None:
        """After a step's vote: the hand-over that came with it becomes the round where the
        step ``committed``, and is dropped otherwise."""
        pending, gathered, self.pending, self.gathered = (self.pending, self.gathered,
                                                          None, None)
        if committed and pending is not None and gathered is not None:
            self.keep(pending, gathered, [])

    def log_step(self, mean: torch.Tensor | tuple[torch.Tensor, int],
                 losses: tuple[float, int]) -> None:
        self.log.append((mean, losses))
        self._log_bytes += _bytes(mean)

    def due(self, next_step: int) -> bool:
        """This group would hand over in step ``next_step``: ``every`` steps after the last
        round, and no sooner than the last hand-over's time divided by ``share``, unless the
        log since holds as many bytes as the round (host memory stays within two rounds).
        The groups hand over in the step after one that committed with any group's numbers
        saying so (every group that committed it read the same sum; a step that did not
        commit clears it, in every group)."""
        if self.state is None or self.pending is not None:  # a hand-over is under way
            return False
        return (next_step - self.state["global_step"] >= self.every
                and (self.share >= 1 or self.counted  # (then exactly every so many steps)
                     or time.monotonic() - self._at >= self.cost / self.share
                     or self._log_bytes >= self._state_bytes))

    def sent(self) -> dict:
        """What a replacement of this group's place loads (``received``)."""
        return {"round": self.state, "rows": self.rows, "log": list(self.log)}

    def received(self, sent: dict, group: int) -> dict:
        """Keep a live group's ``sent`` round, to redo its log: the state to load (group
        ``group``'s own private state in it)."""
        rows, lengths = sent["rows"]
        mine = rows[group, :int(lengths[group])]
        private = torch.load(io.BytesIO(mine.numpy().tobytes()), weights_only=True)
        self.keep(sent["round"], sent["rows"], list(sent["log"]))
        self.replay, self.hand_next = list(sent["log"]), False
        return {**sent["round"], **private}

    def numbers(self, brings: bool, due: bool, group: int, groups: int) -> list[float]:
        """A step's numbers of the hand-over: this group brings its step (every group must,
        or none commits), hands over in it (then every group does), would hand over in the
        next (``due``), and the length of what it hands over (in a slot of its own, as two
        parts that float32 holds exactly)."""
        handing = brings and self.pending is not None
        lengths = [0.0] * (2 * groups)
        if handing:
            lengths[2 * group:2 * group + 2] = divmod(len(self.blob), SPLIT)
        return [float(brings), float(handing), float(brings and due), *lengths]

    def read(self, summed: list[float], groups: int, exact: bool) -> None:
        """What the numbers (``numbers``), summed over the groups, say; ``exact``: summed
        in a precision that holds the lengths."""
        self.brought, self.handing = round(summed[0]), summed[1] > 0
        self.next = summed[2] > 0
        parts = summed[3:]  # (read where the groups hand over in this step only)
        self.lengths = [round(parts[2 * g]) * SPLIT + round(parts[2 * g + 1])
                        for g in range(groups)] if exact and self.handing else None


def _bytes(mean: torch.Tensor | tuple[torch.Tensor, int]) -> int:
    """A logged step's mean's bytes (each step's: no walk of a nested state)."""
    return mean[0].nbytes if isinstance(mean, tuple) else mean.nbytes


def serialized(state: dict | None) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def gather_blobs(replica: Replica, group: int, groups: int, blob: bytes,
                 lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every group's ``blob``, as rows of bytes (row g: group g's, its length apart): the
    blobs, each after its group's number and length and padded to the longest, gathered (a
    group missing from the step, or one that sends nothing, leaves its row empty).
    ``lengths``: the groups' blob lengths, known already (else the longest is gathered
    first)."""
    if lengths is None:
        lengths = replica.start_gather(torch.tensor([len(blob)])).wait().reshape(-1).tolist()
    longest = max(lengths, default=0)
    rows = torch.zeros(groups, longest, dtype=torch.uint8)
    found = torch.zeros(groups, dtype=torch.int64)
    if longest == 0:
        return rows, found
    padded = torch.zeros(16 + longest, dtype=torch.uint8)
    padded[:16] = torch.tensor([group + 1, len(blob)]).view(torch.uint8)
    if blob:
        padded[16:16 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    for row in replica.start_gather(padded).wait():
        number, length = row[:16].clone().view(torch.int64).tolist()
        if number:  # (0: a group that did not take part)
            rows[number - 1], found[number - 1] = row[16:], length
    return rows, found
