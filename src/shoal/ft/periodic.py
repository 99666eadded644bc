"""A live session under the periodic strategies (local_sgd, diloco): the groups train
apart and meet the others only every few steps (``shoal.ft.session`` for the rest).

    session.join(contribution)    # the first step of this process (a replacement heals here)
    mean = session.meet(flat)     # a meeting, held until it commits

Under 'exact' each meeting also hands every group the others' private state (what differs
between groups: the inner optimizer), so that a replacement starts again from its own group's
state at the last meeting and redoes the steps since, while the others wait at the next.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from shoal.ft.config import ReplicaPlace
from shoal.ft.rounds import serialized
from shoal.ft.session import LiveSession
from shoal.ft.step import GroupState, StepOutcome, copied


class PeriodicSession(LiveSession):
    """A live session whose groups meet every few steps, not at each."""

    periodic = True

    def __init__(self, place: ReplicaPlace, group_rank: int, group_size: int,
                 state: GroupState,
                 record: Callable[..., None] = lambda step, **fields: None,
                 least: Callable[[list[int]], list[int]] = lambda values: values):
        super().__init__(place, group_rank, group_size, state, record, least=least)
        self.joined = False
        self.round_due = False  # a meeting committed: keep the round's state next
        self._contributes = True  # False: the meeting under way counts this group out
        self._round_samples = 0  # this group's samples since the last meeting
        self._moved = False  # 'available': this group healed in a meeting (its step moved)

    def finish(self, step: int) -> None:
        """After the last step (``step``): the samples skipped, said; no more quorum (the
        last meeting held every group)."""
        self._say_skipped(step)

    def join(self, blank: Callable[[], torch.Tensor]) -> StepOutcome:
        """At this process's first step: meet the others. At the job's start every group
        is at step 0 and this is a meeting with nothing to average. A replacement heals
        here: under 'exact' from its own group's state at the last meeting
        (HEALED: it redoes its steps since, and the others wait at the meeting); under
        'available' from a live group's state now (GO, with ``joins_meeting``: it takes
        this meeting's mean without adding to it, and ``after_meeting`` says HEALED).
        ``blank()``: a meeting's contribution (its values are not used)."""
        if self.joined:
            return StepOutcome.GO
        self.joined = True
        self._start_quorum()
        if self.replica.step == 0:  # the start: the meeting that gives out private states
            self.meet(blank().zero_(), start=True)
            return StepOutcome.GO
        if self._exact:  # this meeting is held again once this group has caught up
            self._quorum = None
            self._attempt(blank().zero_(), abstain=True)
            self.replica.commit()  # (no: the others see this group's weight 0)
            self.redone = True  # until the meeting: the others are there already
            self._say(f"redoes its steps since the last meeting (step {self._received_step}) "
                      "while the other groups wait")
            return StepOutcome.HEALED
        self._contributes = False
        return StepOutcome.GO

    @property
    def joins_meeting(self) -> bool:
        """Healed in ``join`` under 'available': the meeting under way is this group's
        too, though no meeting is due at its step."""
        return not self._contributes

    def after_meeting(self) -> StepOutcome:
        """After a step's meeting, if any: HEALED when this group
        healed in it ('available': its step moved to a live group's); else GO, with the
        state just after the meeting kept under 'exact' (what a replacement starts again
        from, with its own private state)."""
        if self._moved:
            self._moved = False
            return StepOutcome.HEALED
        if self.round_due:
            self.rounds.state = copied(self.state.state_dict(heal=True))
            self.round_due = False
        return StepOutcome.GO

    def count_samples(self, samples: int) -> None:
        """This group's samples in a step (what a missing group skips)."""
        self._round_samples += samples

    def meet(self, flat: torch.Tensor, start: bool = False) -> torch.Tensor:
        """The mean of ``flat`` over the groups, held again until it
        commits (a group lost in it, or one catching up under 'exact'). Under 'available'
        the mean is over the groups that bring something (a group just healed does not)."""
        said = False
        while True:
            if self._quorum is None:
                self._started = time.monotonic()
                self._quorum = self._wait.join()
            quorum, self._quorum = self._quorum, None
            if quorum.healed and not start:  # behind ('available'): now a live group's clone
                self._contributes, self._moved = False, True
            mean, bringing, rows = self._attempt(flat.clone())
            self._failed = not self.replica.commit()
            if not self._failed:
                break
            if not said and not start:
                self._say(f"the meeting at step {self.state.global_step} did not commit "
                          "(a replica group failed or is catching up): it is held again")
                said = True
        self._contributes, self.redone = True, False
        self.rounds.rows, self.round_due = rows, self._exact
        groups = self.place.groups
        if bringing < groups and not start:
            self.skipped_samples += (groups - bringing) * self._round_samples
        if bringing != self._participants and not start:
            step = self.state.global_step
            if bringing < groups:
                self._say(f"the meeting at step {step}: {bringing} of {groups} replica "
                          "groups bring their steps; the others' samples are skipped "
                          "(policy available)")
            else:
                self._say(f"the meeting at step {step}: all {groups} replica groups bring "
                          f"their steps again; {self.skipped_samples} samples skipped while "
                          "some were missing")
            self._participants = bringing
            self._record_change(step, bringing)
        self._round_samples = 0
        return mean

    def _attempt(self, flat: torch.Tensor, abstain: bool = False
                 ) -> tuple[torch.Tensor, int, tuple | None]:
        """One try of a meeting in the quorum under way: (mean, groups that brought to it,
        every group's private state under 'exact'); kept only if the meeting commits.

        Each group sends a weight with its share: 1, or 0 when it brings nothing (healed
        in this meeting). A commit vote is taken inside each group only, so the weights'
        sum is what every group sees alike: under 'exact' a meeting short of a group does
        not commit anywhere. Under 'exact' the shares are divided first (as one process
        group does) and the private states go with them."""
        groups = self.place.groups
        weight = 0.0 if abstain or not self._contributes else 1.0
        if self._exact:
            flat /= groups
        share = flat.reshape(-1) if weight else torch.zeros_like(flat.reshape(-1))
        sent = torch.cat([share, flat.new_full((1,), weight)])
        self.replica.sum(sent)
        bringing = round(float(sent[-1]))
        rows = None
        if self._exact:
            rows = self._gather(b"" if abstain else serialized(self.state.private_state()))
            if bringing < groups:
                self.replica.abstain()
            return sent[:-1], bringing, rows
        return sent[:-1] / max(bringing, 1), bringing, rows
