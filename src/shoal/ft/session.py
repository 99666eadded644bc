"""One replica group's side of a live job, step by step.

    if session.begin_step() is StepOutcome.HEALED:   # quorum; a replacement heals here
        ...                       # go on from the loaded state's step and data position
    ... forward, backward ...
    if session.end_step(grads, samples, step) is StepOutcome.AGAIN:
        ...                       # a group failed during the step: it is done again

A step that does not commit changes nothing (no optimizer step, no counter), so doing it
again from where it began loses no step. Under 'exact' a step commits only with every group
in it: while one is missing the others wait in the next quorum.

Under a compression with error feedback (powersgd, topk) each rank keeps a residual of its
own, which no live group holds. Under 'exact' every few steps (``compression_state_every``,
and seldom enough that hand-overs take at most ``compression_state_share`` of the run) each
group hands the others its compression state, and each keeps the averaged gradients of the
steps since: a replacement starts again from there with its own group's compression
state and redoes those steps alone (their forward and backward, with the others' mean),
while the others wait at the next quorum (``shoal.ft.rounds`` keeps the hand-over and the
log). A step that does not commit is undone in the compression state too.

The periodic strategies (local_sgd, diloco) meet the other groups only every few steps:
``shoal.ft.periodic``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch

from shoal.ft.across import AcrossGroups, Carried, TopKAcrossGroups
from shoal.ft.config import ENV_OPENED, ReplicaPlace
from shoal.ft.engine import Quorum
from shoal.ft.quorum import QuorumWait
from shoal.ft.rounds import Rounds, gather_blobs, serialized
from shoal.ft.step import (
    GroupState,
    LiveError,
    StepOutcome,
    copied,
    loss_parts,
    state_bytes,
    unflatten,
)
from shoal.parallel.topk import sum_of_selections
from shoal.runtime import heartbeat


class LiveSession:
    """The quorum, the average across groups and the commit of each step, and what a
    replacement loads from a live group."""

    periodic = False
    """The groups meet every few steps, not at each (``shoal.ft.periodic``)."""

    def __init__(self, place: ReplicaPlace, group_rank: int, group_size: int,
                 state: GroupState,
                 record: Callable[..., None] = lambda step, **fields: None,
                 wire: torch.dtype | None = None, feedback: bool = False,
                 least: Callable[[list[int]], list[int]] = lambda values: values):
        """``state``: what a heal sends and loads; ``feedback``: each rank keeps an error
        feedback of its own (powersgd, topk), which a step that does not commit undoes;
        ``record(step, **fields)``: a change of who takes part, for the run's metrics;
        ``least(values)``: the least of each of ``values`` over this group's processes (a
        collective inside the group, where it has several)."""
        from shoal.ft.engine import Replica  # imports torchft: only in a live job

        self.place = place
        self.talks = group_rank == 0  # one line per group, not per rank
        self.writes = place.group == 0
        """Group 0: it writes the job's metrics and checkpoints while it takes part (see
        ``saves``), and reports the run's progress."""
        self.skipped_samples = 0
        """Samples of missing groups skipped (policy 'available'), over the whole run."""
        self._recorded = 0  # skipped_samples in the last replica_groups record
        self.healed: list[dict] = []
        """Each heal of this group: step, bytes, seconds."""
        self.redone = False
        """The step that last committed was one this group had committed before, done again
        bitwise ('exact': a replacement redoing its group's steps alone)."""
        self.state, self._record = state, record
        self._wire = wire  # the precision gradients are sent in across groups (fp16, bf16)
        self._quorum: Quorum | None = None  # the quorum of the step under way
        self._steady = False  # the next step reuses the last quorum (see _average)
        self._asked = False  # a group asked for a full quorum in the step's average
        # The step's numbers, on their way in backward, or their sum under way
        # (send_numbers).
        self._sending: Carried | torch.futures.Future[torch.Tensor] | None = None
        # Where the gradients cross the groups in DDP's hook (``attach``).
        self._across: AcrossGroups | TopKAcrossGroups | None = None
        self.step_losses: tuple[float, int] = (0.0, 0)
        """The last step's losses of this rank and the same rank of every other group: their
        sum (float64) and micro-batches (see ``end_step``)."""
        self._full_at = 0.0  # when this group last asked the lighthouse
        self._reuses = 0  # steps that reused the last full quorum
        self._several = group_size > 1
        """This group has several processes: they agree on the steps of full quorums and
        hand-overs (each process's clock would choose a step of its own)."""
        self.quorums = 0
        """Quorums this process asked the lighthouse for, for its steps (not reused)."""
        self.quorum_seconds = 0.0
        """The time this process spent in them, but its first (where it waits for every
        group to start, or heals as a replacement: ``healed``)."""
        self._participants = place.groups
        self._started = 0.0
        self._failed = False  # this group's last try of a step (or meeting) did not commit
        self.own_part: Callable[[int], None] | None = None
        """Load this group's own part of the checkpoint of a step (its error feedback, its
        replica), where it kept one: after the start's copy of another group's state."""
        self.before_wait: Callable[[], None] = lambda: None
        """Called as this group starts to wait at a quorum (the Trainer's: a preemption
        signal that came since the last step ends the run here)."""
        self._leaving: int | None = None  # the exit code of a stop in a quorum wait
        self._feedback = feedback
        self._exact = place.config.policy == "exact"
        # 'exact' under powersgd, topk: hand-overs of the compression state, and a log.
        self._logged = self._exact and self._feedback
        self.rounds = Rounds(place.config.compression_state_every,
                             place.config.compression_state_share, counted=self._several)
        """'exact': this group's state at the last meeting (periodic) or hand-over (under
        powersgd, topk), and the steps since."""
        self._kept: dict | None = None  # this rank's private state as the step began
        try:
            self.replica = Replica(place, group_rank, group_size, self._send, self._receive)
        except RuntimeError as exc:  # torchft's: the lighthouse does not answer
            raise LiveError(f"replica group {place.group}: cannot join the replica groups "
                            f"({str(exc).splitlines()[0][:200]})") from None
        self._wait = QuorumWait(place, self.replica, self._several, least, self._say,
                                lambda: self.saves_in_wait, lambda: self.before_wait())
        os.environ[ENV_OPENED] = "1"

    def _send(self) -> dict:
        if self.rounds.state is not None:  # 'exact': the last meeting's or hand-over's
            return {**self.rounds.sent(), "skipped_samples": self.skipped_samples}
        return {"trainer": self.state.state_dict(heal=True),
                "skipped_samples": self.skipped_samples}

    def _receive(self, state: dict) -> None:
        if "round" in state:  # this group's own state at the last meeting or hand-over
            self.state.load_state_dict(self.rounds.received(state, self.place.group),
                                       heal=True)
            self._received_step = state["round"]["global_step"]
        else:
            self.state.load_state_dict(state["trainer"], heal=True)
            self._received_step = state["trainer"]["global_step"]
        self.skipped_samples = state["skipped_samples"]
        self._received = state_bytes(state)
        if self.replica.step == 0 and self.own_part is not None:
            # The start's copy of the first group's state: a group that resumed from a
            # checkpoint (every group lost at once) takes its own part of the step back.
            self.own_part(self._received_step)

    def _say(self, message: str) -> None:
        if self.talks:
            print(f"shoal: replica group {self.place.group}: {message}", file=sys.stderr,
                  flush=True)

    def begin_step(self) -> StepOutcome:
        """Meet the other groups for the next step (once, also when the step is started
        again after a heal): GO, or HEALED (this group now holds a live group's state)."""
        if self._logged and self._across is not None:  # topk, in DDP's hook
            self._across.muted = bool(self.rounds.replay)  # redone alone: crosses nothing
        if self.rounds.replay:  # a logged step, redone alone
            return StepOutcome.GO
        if self._quorum is None:
            if self._steady:  # nothing changed since the last quorum: no round trip
                self._quorum = self.replica.again()
                self._reuses += 1
            else:
                self._start_quorum()
                if self._healed_here():
                    if self.rounds.replay:
                        self._sit_out()
                    return StepOutcome.HEALED
        if self._feedback:
            self._kept = self.state.private_state()
            rounds = self.rounds
            rounds.blob = b""
            if self._logged and (rounds.state is None or rounds.hand_next):
                started = time.monotonic()
                rounds.pending = copied(self.state.state_dict(heal=True))
                rounds.blob = serialized(self._kept)
                rounds.cost = time.monotonic() - started
        return StepOutcome.GO

    def _sit_out(self) -> None:
        """'exact', just healed from a hand-over: send nothing to the step under way (zeros,
        weight 0), so that no group commits it, and redo the logged steps alone, while the
        others wait at the next quorum."""
        self._quorum = None
        zeros = self.state.blank_gradients()
        with heartbeat.waiting():
            if isinstance(self._across, TopKAcrossGroups):  # the others gather in backward
                numbers = self._numbers((0.0, 0), brings=False)
                self._read(self._across.blank(numbers, zeros[0].dtype).sums())
            else:
                self._average(zeros, brings=False)
            if self.rounds.handing:  # the others hand over their compression state now
                self._gather(b"", self.rounds.lengths)
            self.replica.abstain()
            self.replica.commit()
        self._say(f"redoes steps {self._received_step + 1} to "
                  f"{self._received_step + len(self.rounds.replay)} alone while the other "
                  "groups wait")

    def _start_quorum(self) -> Quorum:
        """The quorum of a step (kept for it), which a group behind heals in. A job starts
        whole: its first step waits for every group, also under 'available' (whose
        lighthouse forms a quorum of whoever is there)."""
        reuses = self._wait.reuses_after(self._full_at, self._reuses + 1)
        self._started = self._full_at = time.monotonic()
        self.quorums += 1
        self._quorum = self._wait.join(reuses)
        # (every process of a group decides alike: whether each healed is its own; a group
        # that resumed from a checkpoint starts no job: the others may be gone for good)
        while (self.replica.step == 0 and self.state.global_step == 0
               and not self._healed_here() and self._quorum.participants < self.place.groups):
            time.sleep(0.05)
            self._quorum = self._wait.join(reuses)
        self._reuses = 0
        if self.quorums > 1:
            self.quorum_seconds += time.monotonic() - self._started
        if self._quorum.healed:
            took = time.monotonic() - self._started
            self.healed.append({"step": self._received_step, "bytes": self._received,
                                "seconds": took})
            if self.replica.step > 0:  # at step 0: the start's copy of group 0's weights
                self._say(f"healed from a live group at step {self._received_step} "
                          f"({self._received / 2**20:.2f} MB in {took:.2f} s)")
        return self._quorum

    def _healed_here(self) -> bool:
        """This group healed in its last quorum: as its processes agreed, where it has
        several (at the job's first quorum each may have copied another group's state, or
        not: then the group goes on as it is, each copy being of the same step)."""
        assert self._quorum is not None
        return self._wait.healed_everywhere if self._several else self._quorum.healed

    def end_step(self, grads: Sequence[torch.Tensor], samples: int, step: int,
                 losses: tuple[float, int] = (0.0, 0), averaged: bool = False
                 ) -> StepOutcome:
        """Average ``grads`` over the groups of the step and vote: COMMITTED (apply the
        step) or AGAIN. (``averaged``: they were averaged in backward, by DDP's hook.)
        ``samples``: this group's samples in the step (what a missing group skipped);
        ``losses``: this rank's loss sum in the step and its micro-batches, whose sum with
        the other groups' travels with the average (``step_losses``; where ``averaged``,
        they went with the gradients: ``send_numbers``)."""
        self.redone = bool(self.rounds.replay)
        if self.redone:  # a logged step redone alone: the others' mean, as it was
            mean, self.step_losses = self.rounds.replay.pop(0)
            if isinstance(mean, tuple):  # topk: every group's selection
                like = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype)
                mean = sum_of_selections(mean[0], like, mean[1])
            unflatten(mean, grads)
            return StepOutcome.COMMITTED
        assert not averaged or self._sending is not None  # (send_numbers)
        quorum, self._quorum = self._quorum, None
        self._steady = False  # until this step commits with every group in it
        # Each wait for the other groups has its own deadline. None where the numbers came
        # with the gradients and this process votes alone (a hand-over beats for its own).
        waits = not isinstance(self._sending, Carried) or not self.replica.alone
        with heartbeat.waiting() if waits else contextlib.nullcontext():
            self._average([] if averaged else grads, losses)
            if self._logged:
                self._hand_over()
            committed = self.replica.commit()
        if self._logged:
            self._log_step(grads, committed)
            self.rounds.hand_next = committed and self.rounds.next
        self._failed = not committed
        if not committed:
            self.replica.drop()  # a group that committed fails its next step at once
            if self._kept is not None:  # the step's error feedback is undone too
                self.state.load_private_state(self._kept)
            self._say(f"step {step + 1} did not commit (a replica group failed or is "
                      "missing): it is done again")
            return StepOutcome.AGAIN
        assert quorum is not None  # begin_step started it
        groups, joined = self.place.groups, quorum.participants
        self._steady = joined == groups and not self._asked
        if joined < groups:
            self.skipped_samples += (groups - joined) * samples
        if joined != self._participants:
            if joined < groups:
                self._say(f"step {step + 1}: {joined} of {groups} replica groups take part; "
                          "the missing groups' samples are skipped (policy available)")
            else:
                self._say(f"step {step + 1}: all {groups} replica groups take part again; "
                          f"{self.skipped_samples} samples skipped while some were missing")
            self._participants = joined
            self._record_change(step + 1, joined)
        return StepOutcome.COMMITTED

    def _average(self, tensors: Sequence[torch.Tensor],
                 losses: tuple[float, int] = (0.0, 0), brings: bool = True) -> None:
        """The mean over the groups of the step, with one more number: whether a group asks
        for a full quorum before the next step.

        A step whose quorum had every group and that committed everywhere leaves nothing
        for a quorum to change: the next step reuses it, without a round trip to the
        lighthouse. A lost group is still noticed at once, by the next step's collective,
        which then fails: that step does not commit, and the one done again meets the
        lighthouse (a replacement heals there). A group asks for a full quorum at least
        every ``quorum_every_s``, so that a lighthouse that is gone is noticed (a group of
        several processes counts it in steps: ``QuorumWait.reuses_after``); all see the same sum,
        so every group holds the next quorum, or none.

        ``losses`` (this rank's loss sum in the step, float64, and its micro-batches) are
        summed with the other groups' in the same collective: each group's sum in slots of
        its own (three float32 parts, exact), so every group reads every group's."""
        sending, self._sending = self._sending, None
        if isinstance(sending, Carried):  # went with the gradients (send_numbers)
            self._read(sending.sums())
            return
        if sending is not None:  # started before backward (send_numbers)
            sent = sending.wait()
        else:
            like = tensors[0] if tensors else None
            sent = torch.tensor(self._numbers(losses, brings),
                                dtype=like.dtype if like is not None else torch.float32,
                                device=like.device if like is not None else None)
            if tensors:
                self.replica.average([*tensors, sent], self._wire, summed=len(sent))
            else:
                self.replica.sum(sent)
        # (float32 and float64 hold each part exactly)
        self._read(sent.tolist(), exact=sent.dtype in (torch.float32, torch.float64))

    def _read(self, got: list[float], exact: bool = True) -> None:
        """What the step's numbers (``_numbers``), summed over the groups, say; ``exact``:
        summed in a precision that holds each part."""
        losses = 3 * self.place.groups
        self.step_losses = (sum(got[:losses]), round(got[losses]))
        self._asked = got[losses + 1] > 0
        if self._logged:
            self.rounds.read(got[losses + 2:], self.place.groups, exact=exact)

    def send_numbers(self, losses: tuple[float, int]) -> None:
        """When the gradients cross the groups in backward (``attach``), before the step's
        last backward: the step's numbers (see ``_average``) go with the gradients where
        they can, else their sum starts now, while backward computes. (Not for a step redone
        alone.)"""
        assert self._across is not None  # attached
        if self.rounds.replay:
            return
        numbers = self._numbers(losses)
        self._sending = (self._across.carry(numbers)
                         or self.replica.start_sum(torch.tensor(numbers)))

    def _numbers(self, losses: tuple[float, int], brings: bool = True) -> list[float]:
        """The step's numbers: each group's loss sum in slots of its own, the micro-batches,
        and whether this group asks for a full quorum; under 'exact' with error feedback,
        the hand-over's (``Rounds.numbers``: a commit vote is taken inside each group, so
        whether every group brings its step travels here). Each slot's sum over the groups
        is exact in float32, in any order: one group's part (zeros from the others), or a
        count."""
        if self._several:  # the same step in every process of the group
            due = self._reuses >= self._wait.may_reuse  # (``QuorumWait._agree``)
        else:
            due = time.monotonic() - self._full_at >= self.place.config.quorum_every_s
        groups, group = self.place.groups, self.place.group
        tail = [0.0] * (3 * groups) + [float(losses[1]), float(due)]
        tail[3 * group:3 * group + 3] = loss_parts(losses[0])
        if self._logged:
            hand = self.rounds.due(self.state.global_step + 1)
            tail += self.rounds.numbers(brings, hand, group, groups)
        return tail

    def _hand_over(self) -> None:
        """After a logged step's average: the hand-over of the compression state, when one
        is due; a vote against the step when a group did not bring it."""
        rounds = self.rounds
        rounds.gathered = None
        if rounds.handing:
            started = time.monotonic()
            with heartbeat.waiting():
                rounds.gathered = self._gather(rounds.blob, rounds.lengths)
            rounds.cost += time.monotonic() - started
        if rounds.brought < self.place.groups:
            self.replica.abstain()

    def _log_step(self, grads: Sequence[torch.Tensor], committed: bool) -> None:
        """After a step's vote: keep its mean (``grads``, where it ``committed``), and the
        hand-over that came with it. Under topk in DDP's hook, the mean is kept as the
        groups' selections it was made of (about 2 x ratio x groups of its bytes; then
        ``grads`` are not needed)."""
        self.rounds.end_hand_over(committed=committed)
        if not committed:
            return
        last = None
        if isinstance(self._across, TopKAcrossGroups):  # (taken: each step's once)
            last, self._across.last = self._across.last, None
        mean: torch.Tensor | tuple[torch.Tensor, int]
        if last is not None:
            mean = (last[0].cpu(), last[1])  # (a view of the gathered rows: no copy)
        else:
            mean = torch.cat([g.reshape(-1) for g in grads]).cpu()
        self.rounds.log_step(mean, self.step_losses)

    def finish(self, step: int) -> None:
        """After the last step (``step``): the samples skipped over the run said and
        recorded, where groups were missing (the changes of who takes part are recorded as
        they come: a group alone to the end has its later steps' skips only here), then one
        more quorum. A commit vote is taken inside each group,
        so a group's last step may fail where the others' committed (its all-reduce timed
        out): such a group, doing that step again, meets the others here and heals from
        them, instead of doing it alone after they have ended (the groups end as one
        model). Two quorums: a group behind heals in the first, and fetches the state only
        after it (over HTTP); the second holds this group until then. Each is given up
        after ``step_timeout_s``, in a line: the others may have ended already (or still
        be busy after their last step, or the lighthouse does not answer)."""
        self._say_skipped(step)
        wait = self.place.config.step_timeout_s
        for _ in range(2):
            try:
                with heartbeat.waiting():
                    self.replica.quorum(timeout_s=wait)
            except Exception:  # noqa: BLE001 - torchft's: a timeout, no lighthouse
                self._say(f"the replica groups did not meet at the end within {wait:g} s (the "
                          "others may have ended already, or the lighthouse does not answer): "
                          "this group ends as it is, its last step committed")
                return

    def _say_skipped(self, step: int) -> None:
        """At the end (``step``): the samples skipped over the run, said and recorded."""
        if self.skipped_samples:
            self._say(f"{self.skipped_samples} samples skipped over the run while replica "
                      "groups were missing (policy available)")
            if self.skipped_samples != self._recorded:  # skipped since the last change
                self._record_change(step, self._participants)

    def _record_change(self, step: int, taking_part: int) -> None:
        """A change of who takes part (or the end), for the run's metrics."""
        self._record(step, kind="replica_groups", taking_part=taking_part,
                     groups=self.place.groups, skipped_samples=self.skipped_samples)
        self._recorded = self.skipped_samples

    def _gather(self, blob: bytes, lengths: list[int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every group's ``blob`` (``shoal.ft.rounds.gather_blobs``)."""
        return gather_blobs(self.replica, self.place.group, self.place.groups, blob, lengths)

    @property
    def needs_gradients(self) -> bool:
        """``end_step`` needs the step's gradients also where they were averaged in
        backward: a logged step redone alone (they become its mean), and under 'exact' with
        error feedback each step's mean is kept (under topk in DDP's hook, as the groups'
        selections: not from the gradients)."""
        return bool(self.rounds.replay) or (
            self._logged and not isinstance(self._across, TopKAcrossGroups))

    @property
    def saves(self) -> bool:
        """This group writes the job's checkpoints and metrics now: it comes first of the
        groups in the last quorum (group 0 where it takes part; under 'available', while
        group 0 is missing, the next one)."""
        return self.replica.leads

    @property
    def reports(self) -> bool:
        """This group reports the run (its progress, its end): the one that ``saves`` once a
        quorum has met (under 'available' the next group, where group 0 failed for good),
        group 0 before."""
        return self.saves if self.replica.participants else self.writes

    @property
    def saves_in_wait(self) -> bool:
        """Whether this group saves where a preemption signal stops it at a quorum: it
        holds a step that committed (it took part in one, or healed), and it writes the
        checkpoints (``saves``) or the group that does may be the one missing: this group's
        last try of a step or meeting did not commit, or its wait has outlasted the
        lighthouse's heartbeat timeout. (Two groups may then save one step: the store keeps
        the first, and a group that finds it committed does not save it again.) In a group
        of several processes, what they agreed (``QuorumWait._agree``)."""
        if self._wait.saves_agreed is not None:
            return self._wait.saves_agreed
        if self.replica.step == 0:
            return False
        waited = time.monotonic() - self._started
        return (self.saves or self._failed
                or waited > self.place.config.heartbeat_timeout_ms / 1000)

    @property
    def everyone(self) -> bool:
        """Every group took part in the last step that committed (or meeting)."""
        return self._participants == self.place.groups

    def attach(self, across: AcrossGroups | TopKAcrossGroups) -> None:
        """The gradients cross the groups in DDP's hook, ``across``: on this session's
        process group across groups."""
        across.replica = self.replica
        self._across = across

    def waiting(self) -> bool:
        """Whether this process now waits for the other groups at a quorum."""
        return self._wait.waiting

    def exit_on_close(self, code: int) -> None:
        """Stopped in a quorum wait (a preemption signal): ``close`` ends the process with
        ``code``."""
        self._leaving = code

    def close(self) -> None:
        self.replica.close()
        if self._leaving is not None:
            # Stopped in a quorum wait: torchft's quorum thread would hold the exit until
            # its own timeout (the state is saved: nothing is left to do).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(self._leaving)
