"""The run every test here trains: examples/digits.yaml, 12 steps, its data through
slow.py (optionally slowed so that a test can signal a job while it trains); in a project
directory of its own, as a user would have it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO
from tests.remote.runs import final_state

STEPS = 12
RUN = ["data.builder=tests.slurm.slow:build_data", f"trainer.max_steps={STEPS}",
       "trainer.progress=false", "trainer.metrics.every=1"]
RUN_DIR = Path("runs/digits")
CHECKPOINTS = f"trainer.checkpoint_dir={RUN_DIR / 'checkpoints'}"


def job_env() -> dict[str, str]:
    """What a job needs from the submitting shell (sbatch and srun pass it on): this
    Python's shoal first on PATH, the repository (tests.slurm.slow) importable, one thread
    per worker."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    bin_dir = os.path.dirname(sys.executable)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": path,
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def project(directory: Path) -> Path:
    """A user's project directory: examples/digits.yaml in it."""
    (directory / "examples").mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(REPO, "examples", "digits.yaml"), directory / "examples")
    return directory


def shoal(*args: str, cwd: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal", *args], cwd=cwd, timeout=timeout,
                          env={**os.environ, **job_env()}, capture_output=True, text=True)


def trained(directory: Path) -> dict:
    """The final model and optimizer of the run in project ``directory``."""
    state, meta = final_state(directory / RUN_DIR)
    assert meta["global_step"] == STEPS, meta["global_step"]
    return state


def start_training_locally(directory: Path, nproc: int) -> subprocess.Popen:
    """Start the run on ``nproc`` processes of this machine (its output in
    ``directory``/output.txt); ``trained_locally`` waits for it."""
    with open(directory / "output.txt", "w") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "shoal", "train", "--config", "examples/digits.yaml",
             "--nproc-per-node", str(nproc), *RUN, CHECKPOINTS], cwd=project(directory),
            env={**os.environ, **job_env()}, stdout=output, stderr=subprocess.STDOUT)


def trained_locally(directory: Path, run: subprocess.Popen, timeout: float = 150) -> dict:
    """The final model and optimizer of ``run`` (from ``start_training_locally``)."""
    code = run.wait(timeout=timeout)
    assert code == 0, (directory / "output.txt").read_text()[-3000:]
    return trained(directory)
