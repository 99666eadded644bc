"""A seeded schedule of faults replays exactly: the same seed draws the same faults, at the
same moments, on the same places."""

from __future__ import annotations

from shoal.chaos import Fault, Schedule


def test_the_same_seed_draws_the_same_schedule_and_another_seed_another():
    draw = dict(groups=3, ranks=2, kills=6, stops=1, lighthouse=1, launchers=1,
                after_end=True)
    schedule = Schedule.draw(7, **draw)
    assert schedule == Schedule.draw(7, **draw)
    assert schedule != Schedule.draw(8, **draw)
    kinds = [fault.kind for fault in schedule.faults]
    assert sorted(kinds[:-1]) == ["kill"] * 6 + ["launcher", "lighthouse", "stop"]
    assert kinds[-1] == "after_end"
    times = [fault.at for fault in schedule.faults[:-1]]
    assert times == sorted(times) and times[0] == 0.5
    assert all(0.3 <= b - a <= 3.0 + 0.01 for a, b in zip(times, times[1:], strict=False))
    for fault in schedule.faults:
        assert fault.kind == "lighthouse" or fault.group in range(3)
        assert fault.kind in ("lighthouse", "launcher") or fault.rank in range(2)
    stop = next(f for f in schedule.faults if f.kind == "stop")
    assert 1.0 <= stop.seconds <= 3.0


def test_a_schedule_says_its_seed_and_each_fault():
    schedule = Schedule(3, (Fault(0.5, "kill", 1, 0), Fault(1.25, "stop", None, 2, 2.0),
                            Fault(2.0, "lighthouse"), Fault(2.5, "launcher", 2),
                            Fault(0.0, "after_end", 0, 1)))
    assert str(schedule) == (
        "chaos seed 3: 0.50 s: SIGKILL g1 rank 0; 1.25 s: SIGSTOP 2 s rank 2; "
        "2.00 s: SIGKILL the lighthouse; 2.50 s: SIGKILL the launcher of g2; "
        "after the last step: SIGKILL after the last step, g0 rank 1")
    assert str(Schedule(4)) == "chaos seed 4: no faults"
    # a job of restarts: ranks only
    assert all(f.group is None for f in Schedule.draw(1, groups=None, ranks=4).faults)


class _Flickering:
    """A job whose one worker shows in every other look at it (a worker that ends, or
    starts again, between two reads of the heartbeats)."""

    def __init__(self, pid: int):
        self.pid, self.looks = pid, 0

    def step(self) -> int:
        return 5

    def running(self) -> bool:
        return True

    def workers(self) -> dict:
        self.looks += 1
        return {(None, 0): (self.pid, 5)} if self.looks % 2 else {}

    def _ours(self, pid: int) -> int:
        return pid


def test_a_worker_gone_between_two_looks_is_still_struck_once_seen():
    """The schedule goes on where the worker it looked for ends as it is found (before, the
    schedule's thread died of a KeyError and its later faults never came)."""
    import subprocess
    import sys

    from shoal.chaos.inject import Chaos

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with Chaos(Schedule(0, (Fault(0.0, "kill", None, 0),)), _Flickering(worker.pid)) \
                as chaos:
            assert worker.wait(timeout=30) == -9  # (a hang guard: struck at once)
        assert [f.kind for f in chaos.fired] == ["kill"]
    finally:
        worker.kill()
