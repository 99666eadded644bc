"""One replica group's side of a live job, step by step.

    session.begin_step()          # quorum; a replacement heals here (raises Redo)
    ... forward, backward ...
    if not session.end_step(grads, samples):
        raise Redo()              # a group failed during the step: it is done again

A step that does not commit changes nothing (no optimizer step, no counter), so doing it
again from where it began loses no step. Under 'exact' a step commits only with every group
in it: while one is missing the others wait in the next quorum.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import torch

from shoal.ft.config import ReplicaPlace
from shoal.ft.engine import Quorum
from shoal.runtime import heartbeat


class LiveError(RuntimeError):
    """A live step cannot go on (no lighthouse, no quorum in time): said in one line."""


class Redo(Exception):
    """The step under way starts again from where it began (after a failed step, or a heal
    that moved this group to the live groups' step)."""


def state_bytes(state: object) -> int:
    """Bytes of the tensors in a (nested) state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


class LiveSession:
    """The quorum, the average across groups and the commit of each step, and what a
    replacement loads from a live group."""

    def __init__(self, place: ReplicaPlace, group_rank: int, group_size: int,
                 state: Callable[[], dict], load: Callable[[dict], None],
                 record: Callable[..., None] = lambda step, **fields: None,
                 wire: torch.dtype | None = None):
        from shoal.ft.engine import Replica  # imports torchft: only in a live job

        self.place = place
        self.talks = group_rank == 0  # one line per group, not per rank
        self.writes = place.group == 0
        """This group writes the job's checkpoints and metrics (the others hold the same)."""
        self.skipped_samples = 0
        """Samples of missing groups skipped (policy 'available'), over the whole run."""
        self.healed: list[dict] = []
        """Each heal of this group: step, bytes, seconds."""
        self._state, self._load, self._record = state, load, record
        self._wire = wire  # the precision gradients are sent in across groups (fp16, bf16)
        self._quorum = None  # the quorum of the step under way
        self._participants = place.groups
        self._started = 0.0
        try:
            self.replica = Replica(place, group_rank, group_size, self._send, self._receive)
        except RuntimeError as exc:  # torchft's: the lighthouse does not answer
            raise LiveError(f"replica group {place.group}: cannot join the replica groups "
                            f"({str(exc).splitlines()[0][:200]})") from None

    def _send(self) -> dict:
        return {"trainer": self._state(), "skipped_samples": self.skipped_samples}

    def _receive(self, state: dict) -> None:
        self._load(state["trainer"])
        self.skipped_samples = state["skipped_samples"]
        self._received = state_bytes(state)
        self._received_step = state["trainer"]["global_step"]

    def _say(self, message: str) -> None:
        if self.talks:
            print(f"shoal: replica group {self.place.group}: {message}", file=sys.stderr,
                  flush=True)

    def begin_step(self) -> None:
        """Meet the other groups for the next step (once, also when the step is started
        again after a heal)."""
        if self._quorum is not None:
            return
        self._started = time.monotonic()
        self._quorum = self._meet()
        # A job starts whole: the first step waits for every group, also under 'available'
        # (whose lighthouse forms a quorum of whoever is there).
        while (self.replica.step == 0 and not self._quorum.healed
               and self._quorum.participants < self.place.groups):
            time.sleep(0.05)
            self._quorum = self._meet()
        if self._quorum.healed:
            took = time.monotonic() - self._started
            self.healed.append({"step": self._received_step, "bytes": self._received,
                                "seconds": took})
            if self._received_step > 0:  # at step 0: the start's copy of group 0's weights
                self._say(f"healed from a live group at step {self._received_step} "
                          f"({self._received / 2**20:.2f} MB in {took:.2f} s)")
            raise Redo()

    def _meet(self) -> Quorum:
        """The step's quorum, tried again until the policy's deadline (a lighthouse that
        the launcher is starting again refuses connections meanwhile)."""
        c = self.place.config
        wait = c.replacement_timeout_s if c.policy == "exact" else c.step_timeout_s
        deadline = time.monotonic() + wait
        while True:
            try:
                # Waiting for the others (or a replacement) is not a hang: the call's own
                # deadline ends it.
                with heartbeat.waiting():
                    return self.replica.quorum()
            except Exception as exc:  # noqa: BLE001 - torchft's: a timeout, no lighthouse
                if time.monotonic() >= deadline:
                    raise LiveError(
                        f"replica group {self.place.group}: no quorum of the replica groups "
                        f"within {wait:g} s ({str(exc).splitlines()[0][:200]}); this group "
                        "stops (its agent restarts it, from the last checkpoint if there is "
                        "one)") from None
                time.sleep(0.2)

    def end_step(self, grads: Sequence[torch.Tensor], samples: int, step: int) -> bool:
        """Average ``grads`` over the groups of the step and vote; True: apply the step.
        ``samples``: this group's samples in the step (what a missing group skipped)."""
        quorum, self._quorum = self._quorum, None
        with heartbeat.waiting():  # each wait for the other groups has its own deadline
            self.replica.average(grads, self._wire)
            committed = self.replica.commit()
        if not committed:
            self._say(f"step {step + 1} did not commit (a replica group failed or is "
                      "missing): it is done again")
            return False
        groups, joined = self.place.groups, quorum.participants
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
            self._record(step + 1, kind="replica_groups", taking_part=joined, groups=groups,
                         skipped_samples=self.skipped_samples)
        return True

    def close(self) -> None:
        self.replica.close()
