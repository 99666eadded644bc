"""Every way a Python process ends, under `shoal run` (workers forked from the preloaded
server, as every restart's are, and new processes, as the first attempt's and
--no-preload's are) and under torchrun, on the same script: the job succeeds exactly where
torchrun's does, and fails with the rank's own status where torchrun says 1, or with 1 under
--torchrun-exit-codes (docs/launcher.md, "How a job ends")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

# What the rank's process exits with, as `python script.py` would: shoal passes it on.
OWN_STATUS = {
    "return": 0, "sys.exit()": 0, "sys.exit(None)": 0, "sys.exit(0)": 0, "sys.exit(3)": 3,
    "sys.exit('message')": 1, "exit()": 0, "raise SystemExit": 0, "os._exit(0)": 0,
    "os._exit(5)": 5, "exception": 1, "signal": 128 + 9,
}


def _statuses(launcher: str, tmp_path) -> dict[str, int]:
    # A hang guard, several times the idle time (about 45 s for the slowest launcher).
    out = subprocess.run([sys.executable, "tests/launch/endings.py", launcher, str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory) -> dict[str, int]:
    return _statuses("torchrun", tmp_path_factory.mktemp("torchrun"))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("launcher", ["shoal-forked", "shoal-no-preload"])
def test_every_ending_ends_the_job_as_under_torchrun(launcher, torchrun, tmp_path):
    shoal = _statuses(launcher, tmp_path)
    assert sorted(shoal) == sorted(torchrun) == sorted(
        f"{ending}/{scope}" for ending in OWN_STATUS for scope in ("one", "all"))
    for case, status in torchrun.items():
        # torchrun exits 0 or 1; shoal succeeds where it does, and fails with the status the
        # rank's process itself ended with.
        assert status == (0 if OWN_STATUS[case.split("/")[0]] == 0 else 1), case
        assert shoal[case] == OWN_STATUS[case.split("/")[0]], case


@pytest.mark.timeout(900)
def test_torchrun_exit_codes_end_every_job_with_torchruns_status(torchrun, tmp_path):
    shoal = _statuses("shoal-torchrun-codes", tmp_path)
    assert shoal == {case: status for case, status in torchrun.items() if case.endswith("/one")}
