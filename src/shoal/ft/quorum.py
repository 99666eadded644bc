"""How a replica group waits for a full quorum of the groups, and how the processes of a
group of several leave that wait together (``QuorumWait``; ``shoal.ft.session`` holds one).

torchft makes each process of a group meet the quorum on its own. A preemption signal may
end one process's wait after the quorum has let another go on, a heal may go through in
some of them and fail in others, and each process's clock would choose a step of its own
for the next full quorum: so, as each leaves the wait, the processes of a group agree in
one collective inside the group on what the group does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from shoal.errors import Preempted
from shoal.ft.config import ReplicaPlace
from shoal.ft.step import LiveError
from shoal.runtime import heartbeat

if TYPE_CHECKING:
    from shoal.ft.engine import Quorum, Replica


class QuorumWait:
    """A group's wait at a full quorum (``join``), tried again until the policy's deadline,
    and what its processes agreed as they left the last one."""

    def __init__(self, place: ReplicaPlace, replica: Replica, several: bool,
                 least: Callable[[list[int]], list[int]], say: Callable[[str], None],
                 saves_in_wait: Callable[[], bool], before_wait: Callable[[], None]):
        """``several``: the group has several processes; ``least(values)``: the least of
        each of ``values`` over them (a collective inside the group); ``say``: one line
        for the group; ``saves_in_wait()``: whether this process would save where a
        preemption signal stops it in the wait; ``before_wait()``: called as it starts to
        wait (``LiveSession``'s)."""
        self.place, self.replica, self._several = place, replica, several
        self._least, self._say, self._saves_in_wait = least, say, saves_in_wait
        self._before = before_wait
        self.waiting = False
        """This process now waits for the other groups at a quorum."""
        self.may_reuse = 0
        """A group of several processes: the steps that may reuse a full quorum, agreed
        inside the group at each one (see ``_agree``)."""
        self.saves_agreed: bool | None = None
        """A group of several processes stopped by a signal in the wait: whether they save,
        as they agreed (``LiveSession.saves_in_wait``)."""
        self._fell_back = False  # a heal went through in only some processes: met again
        self.healed_everywhere = False
        """A group of several processes: every one of them healed in the last quorum (what
        they agreed; each alone may have healed or not)."""

    def reuses_after(self, previous: float, steps: int) -> int:
        """A group of several processes, asking for a full quorum: how many steps may reuse
        it, so that the next full one comes about ``quorum_every_s`` later at the pace of
        the ``steps`` since the one before (begun at ``previous``; 0: none yet, and then the
        next step holds one). Every process of the group must ask for the next full quorum
        at the same step (each waits for the others in it): the group takes the least of
        its processes' counts (``join``)."""
        pace = (time.monotonic() - previous) / steps if previous else 0.0
        # (at most 2**31 steps: quorum_every_s may be infinite)
        count = min(self.place.config.quorum_every_s / pace, 2.0**31) - 1 if pace > 0 else 0
        return max(0, int(count))

    def join(self, reuses: int | None = None) -> Quorum:
        """The step's (or meeting's) quorum, tried again until the policy's deadline (a
        lighthouse that the launcher is starting again refuses connections meanwhile).

        The processes of a group of several leave it together: as each leaves (with a
        quorum, stopped by a preemption signal, or past its deadline) they agree in one
        collective inside the group (``_agree``) on what the group does. A signal may end
        one process's wait after the quorum has let another go on (each on its own, the one
        would save alone and the other wait for it in the step), and a heal may go through
        in some processes and fail in others (each fetches its own state)."""
        while True:
            quorum: Quorum | None = None
            ended: Preempted | LiveError | None = None
            try:
                quorum = self._join_once()
            except (Preempted, LiveError) as exc:
                if not self._several:
                    raise
                ended = exc
            if not self._several:
                assert quorum is not None
                return quorum
            with heartbeat.waiting():  # (the others may still wait at the quorum)
                if self._agree(reuses, quorum, ended):
                    assert quorum is not None  # (else ``_agree`` raised)
                    return quorum

    def _agree(self, reuses: int | None, quorum: Quorum | None,
               ended: Preempted | LiveError | None) -> bool:
        """A group of several processes, leaving a quorum wait with ``quorum`` or ``ended``:
        the least ``reuses`` of its processes (see ``reuses_after``), and what the group
        does. Stopped by a signal in any process: every one raises ``Preempted``, and they
        save where each holds the same committed step and any would save
        (``saves_in_wait``). Past its deadline in any: every one raises ``LiveError``. A
        heal that went through in only some: each holds the least step again and False
        (meet again, where every process heals; twice: ``LiveError``)."""
        step = self.replica.step
        if self.replica.healing:  # (read after the step: the heal set it first)
            step = -1  # stopped before its heal was loaded: not that step's state
        healed = int(quorum is not None and quorum.healed)
        # (the least of a negated value: the greatest)
        least, minus_signum, minus_wants, lowest, minus_highest, all_healed, minus_ended = \
            self._least([reuses or 0, -ended.signum if isinstance(ended, Preempted) else 0,
                         -int(self._saves_in_wait()), step, -step, healed,
                         -int(bool(ended))])
        if reuses is not None:
            self.may_reuse = least
        self.healed_everywhere = bool(all_healed)
        if minus_signum:
            self.saves_agreed = minus_wants < 0 and 0 < lowest == -minus_highest
            raise Preempted(-minus_signum)
        group = self.place.group
        if minus_ended:
            raise ended or LiveError(
                f"replica group {group}: another of its processes found no quorum of the "
                "replica groups in time; this group stops (its agent restarts it)")
        # (Whether a process healed says nothing by itself: at the job's first quorum each
        # rank of a group may copy the weights of a group of its own choosing, or none.)
        if lowest == -minus_highest:
            if self._fell_back and not all_healed:
                raise LiveError(f"replica group {group}: no live group to heal from again "
                                "after a heal that failed in some of its processes; this "
                                "group stops (its agent restarts it)")
            self._fell_back = False
            return True
        if self._fell_back:
            raise LiveError(f"replica group {group}: a heal failed again in some of its "
                            "processes; this group stops (its agent restarts it)")
        self._say(f"a heal to step {-minus_highest} failed in some of its processes: the "
                  "group meets the others again, and every process heals")
        self.replica.fall_back(lowest)
        self._fell_back = True
        return False

    def _before_wait(self) -> None:
        """The Trainer's ``before_wait`` (a preemption signal since the last step raises
        ``Preempted``). In a group of several processes only once this process has asked
        for the quorum: torchft asks the lighthouse once every process of a group has, and
        the others wait for it there."""
        try:
            self._before()
        except Preempted:
            if self._several:
                with contextlib.suppress(Exception):  # (a timeout: the request is out)
                    self.replica.quorum(timeout_s=1.0)
            raise

    def _join_once(self) -> Quorum:
        """``join``'s quorum, for this process alone."""
        c = self.place.config
        wait = c.replacement_timeout_s if c.policy == "exact" else c.step_timeout_s
        deadline = time.monotonic() + wait
        while True:
            try:
                # Waiting for the others (or a replacement) is not a hang: the call's own
                # deadline ends it.
                with heartbeat.waiting():
                    self.waiting = True  # a preemption signal may end this wait
                    try:
                        self._before_wait()
                        return self.replica.quorum()
                    finally:
                        self.waiting = False
            except Exception as exc:  # noqa: BLE001 - torchft's: a timeout, no lighthouse
                if time.monotonic() >= deadline:
                    raise LiveError(
                        f"replica group {self.place.group}: no quorum of the replica groups "
                        f"within {wait:g} s ({str(exc).splitlines()[0][:200]}); this group "
                        "stops (its agent restarts it, from the last checkpoint if there is "
                        "one)") from None
                time.sleep(0.2)
