"""What each mode promises, under faults at random moments: a few short seeded schedules
(SIGKILLs of random workers, a SIGSTOP, the lighthouse and a group's launcher killed, a kill
after the last step) on the digits job, for restarts and live 'exact' and 'available',
across the compressions and the periodic strategies; each against the same setting without
faults, run beside it. A failing schedule replays with its seed (benchmarks/chaos.py
--seeds S runs long ones)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from shoal.chaos import Schedule
from shoal.chaos.trial import Setting, broken, trial
from tests.helpers import REPO

pytest.importorskip("torchft")

# (setting, seed, faults beyond kills and a stop: lighthouse and launcher kills)
CASES = {
    "restart powersgd": (Setting("restart", compression="powersgd", groups=3, epochs=12),
                         12, False),
    "exact none": (Setting("exact", epochs=12), 13, True),
    "exact fp16": (Setting("exact", compression="fp16", epochs=12), 14, False),
    "exact powersgd": (Setting("exact", compression="powersgd", epochs=12), 15, False),
    "exact topk": (Setting("exact", compression="topk", groups=3, epochs=12), 16, False),
    "exact local_sgd": (Setting("exact", strategy="local_sgd", epochs=12), 17, False),
    "exact diloco": (Setting("exact", strategy="diloco", epochs=12), 18, False),
    "available none": (Setting("available", epochs=12), 19, True),
    "available topk": (Setting("available", compression="topk", epochs=12), 20, False),
}
RUN_S = 300  # a hang guard for one run under faults, several times its length here


@pytest.mark.timeout(RUN_S + 60)
@pytest.mark.parametrize("case", list(CASES))
def test_a_mode_keeps_its_promise_under_a_seeded_schedule(case, tmp_path, monkeypatch):
    setting, seed, extras = CASES[case]
    monkeypatch.chdir(REPO)  # (the setting's run config)
    live = setting.mode != "restart"
    schedule = Schedule.draw(seed, groups=setting.groups if live else None,
                             ranks=setting.group_size if live else setting.groups,
                             kills=3, stops=1, lighthouse=int(extras), launchers=int(extras),
                             gap=(0.3, 1.5), stop_s=(1.0, 2.0), after_end=True)
    with ThreadPoolExecutor(1) as pool:  # they share nothing: side by side
        calm = pool.submit(trial, setting, tmp_path / "calm", Schedule(seed))
        # its last step: the calm run's, known when it ends (the faults come before)
        steps = setting.epochs * _steps_per_epoch(setting)
        faulted = trial(setting, tmp_path / "faulted", schedule, last_step=steps,
                        timeout=RUN_S)
        reference = calm.result()
    assert reference.run.ended, reference.run.output[-3000:]
    assert reference.metrics["global_step"] == steps
    assert faulted.run.fired, f"{schedule}: no fault found the job running"
    problems = broken(setting, faulted, reference)
    assert not problems, (f"{schedule}\n" + "\n".join(faulted.run.log) + "\n"
                          + "; ".join(problems) + "\n" + faulted.run.output[-4000:])


def _steps_per_epoch(setting: Setting) -> int:
    """The digits job's (examples/digits.yaml): 1437 training samples, batches of 32 a
    data-parallel rank."""
    ranks = setting.groups * setting.group_size
    return -(-1437 // (32 * ranks))
