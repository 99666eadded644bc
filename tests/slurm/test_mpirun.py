"""Open MPI's mpirun starting `shoal train` once per worker, on a test host (a network
namespace: nothing of mpirun's leaves it); the run equals 2 processes started by shoal."""

from __future__ import annotations

import os

import pytest

from tests.helpers import states_equal
from tests.multihost import hosts as test_hosts
from tests.slurm.runs import CHECKPOINTS, RUN, job_env, project, trained

pytestmark = pytest.mark.slurm


@pytest.mark.timeout(180)
def test_mpirun_with_two_ranks_equals_two_local_processes(mpirun, local_run, tmp_path):
    why = test_hosts.unavailable()
    if why:
        pytest.skip(why)
    local_run.start(2)  # beside mpirun's job
    project(tmp_path)
    argv = [mpirun, "-n", "2", "--allow-run-as-root", "shoal", "train", "--config",
            "examples/digits.yaml", *RUN, CHECKPOINTS]
    with test_hosts.Hosts(1) as host:
        out = host.run(0, argv, cwd=tmp_path, env={**os.environ, **job_env()},
                       capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "shoal: Open MPI: 2 processes (1 node x 2) started by the scheduler, master " \
        "127.0.0.1:29500" in out.stderr, out.stderr
    assert states_equal(trained(tmp_path), local_run(2))
