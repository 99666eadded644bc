"""A public-style DDP script written for torchrun (only torch, ending with
``sys.exit(main())``), unmodified, under torchrun and under `shoal run` with the same
arguments and seeds: the same exit status, the same losses bit for bit, the same weights."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.helpers import REPO, run_shoal, states_equal

SCRIPT = os.path.join(REPO, "tests", "launch", "ddp_example.py")
LOSS = re.compile(r"^(?:\[rank\d\]: )?(rank \d local \d epoch \d+ step \d+ loss \S+)$",
                  re.MULTILINE)


@pytest.mark.timeout(3 * 150 + 30)  # up to 3 torchrun runs, shoal's beside the first
def test_a_torchrun_script_runs_the_same_under_shoal(tmp_path):
    args = ["--epochs", "2", "--lr", "0.1"]
    # torchrun's workers share its stdout, where their lines can mix: each rank's own
    # output is read from torchrun's per-rank logs instead. A worker under torchrun aborts
    # now and then in gloo's teardown at interpreter exit, after its last line (SIGABRT,
    # "terminate called without an active exception"; shoal's bootstrap frees the process
    # group before the interpreter ends): torchrun's run is taken from up to 3 tries.
    # shoal's run goes beside torchrun's: they share nothing.
    with ThreadPoolExecutor(1) as pool:
        shoal_run = pool.submit(run_shoal, "run", "--nproc_per_node=2", SCRIPT, *args,
                                "--out", str(tmp_path / "shoal.pt"), timeout=150)
        for attempt in range(3):
            logs = tmp_path / f"torchrun-logs-{attempt}"
            torchrun = subprocess.run(
                [os.path.join(os.path.dirname(sys.executable), "torchrun"),
                 "--nproc_per_node=2", f"--log_dir={logs}", "--redirects=3", SCRIPT, *args,
                 "--out", str(tmp_path / "torchrun.pt")],
                cwd=REPO, capture_output=True, text=True, timeout=150,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
            if torchrun.returncode == 0 or "SIGABRT" not in torchrun.stderr:
                break
        shoal = shoal_run.result()
    assert torchrun.returncode == shoal.returncode == 0, (torchrun.stderr, shoal.stderr)
    theirs = [line for path in sorted(logs.rglob("stdout.log"))
              for line in LOSS.findall(path.read_text())]
    ours = LOSS.findall(shoal.stdout)
    assert len(theirs) == 2 * 2 * 8  # ranks x epochs x steps
    assert sorted(ours) == sorted(theirs)
    # Each rank's own lines in the order it printed them.
    for rank in (0, 1):
        assert [x for x in ours if x.startswith(f"rank {rank}")] == \
            [x for x in theirs if x.startswith(f"rank {rank}")]
    assert states_equal(torch.load(tmp_path / "torchrun.pt", weights_only=True),
                        torch.load(tmp_path / "shoal.pt", weights_only=True))
