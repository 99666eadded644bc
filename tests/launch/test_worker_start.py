"""The first workers of `shoal run` start as new processes, as torchrun's do; a worker
restarted after a failure is forked from a server that has imported torch (Linux): it starts
without importing torch again, and sees what a worker started as a new process
(--no-preload) sees: environment, arguments, directory, sys.path."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import processes_with, run_shoal

SCRIPT = textwrap.dedent("""\
    import json, os, signal, sys, time
    preloaded = "torch._dynamo" in sys.modules  # before the script imported anything
    import torch
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT",
            "SHOAL_TEST_MARK", "OMP_NUM_THREADS"]
    seen = {"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv,
            "cwd": os.getcwd(), "path0": sys.path[0], "preloaded": preloaded,
            "parent": os.getppid(), "session": os.getsid(0) == os.getpid(),
            "threads": torch.get_num_threads(), "policy": os.sched_getscheduler(0),
            "parent_title": open(f"/proc/{os.getppid()}/cmdline").read().strip("\\0")}
    with open(os.path.join(sys.argv[1], f"seen_{attempt}_{os.environ['RANK']}"), "w") as f:
        json.dump(seen, f)
    if attempt == "0" and os.environ["RANK"] == "1":
        while not os.path.exists(os.path.join(sys.argv[1], "seen_0_0")):
            time.sleep(0.05)  # rank 0 got this far too
        os.kill(os.getpid(), signal.SIGKILL)
""")


def _restart_once(tmp_path, preload: bool) -> tuple:
    """Run SCRIPT on 2 ranks with one restart (rank 1 is killed in attempt 0); the run's
    output and what each rank of each attempt saw, by "attempt_rank"."""
    out = tmp_path / ("forked" if preload else "command")
    out.mkdir()
    script = tmp_path / "job_worker_start.py"
    # Variables elastic sets for each worker, already in the launcher's environment:
    # elastic's values must win. No OMP_NUM_THREADS: the launcher sets it for its workers
    # after it has imported torch (which reads it once, when imported), in a new interpreter.
    env = {"SHOAL_TEST_MARK": "from the launcher", "TORCHELASTIC_RESTART_COUNT": "7",
           "GROUP_RANK": "5", "OMP_NUM_THREADS": None}
    flags = [] if preload else ["--no-preload"]
    result = run_shoal("run", "--nproc-per-node", "2", "--max-restarts", "1", *flags,
                       str(script), str(out), "rank${local_rank}", cwd=str(tmp_path), env=env,
                       fork=False)
    return result, {p.name[len("seen_"):]: json.loads(p.read_text()) for p in out.iterdir()}


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_a_restarted_worker_is_forked_and_sees_what_a_new_process_sees(tmp_path):
    (tmp_path / "job_worker_start.py").write_text(SCRIPT)
    # The two runs go side by side: each writes to its own folder.
    with ThreadPoolExecutor(1) as pool:
        preloaded = pool.submit(_restart_once, tmp_path, preload=True)
        results = [_restart_once(tmp_path, preload=False), preloaded.result()]
    for result, _ in results:
        assert result.returncode == 0, result.stderr
        assert "Warning" not in result.stderr, result.stderr
    assert processes_with("job_worker_start.py") == []
    (_, command), (_, forked) = results
    assert sorted(forked) == sorted(command) == ["0_0", "0_1", "1_0", "1_1"]
    # The first attempt's workers are new processes; the restarted ones were forked, from
    # one server, and did not import torch again.
    assert [forked[k]["preloaded"] for k in sorted(forked)] == [False, False, True, True]
    assert not any(seen["preloaded"] for seen in command.values())
    assert len({forked[k]["parent"] for k in ("1_0", "1_1")}) == 1
    assert forked["1_0"]["parent"] != forked["0_0"]["parent"]
    # That server serves the launcher (the first workers' parent), and says so.
    launcher = forked["0_0"]["parent"]
    assert forked["1_0"]["parent_title"] == f"shoal forkserver (serves pid {launcher})"
    for key, seen in forked.items():
        attempt, rank = key.split("_")
        assert seen["env"] == {
            "RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2", "GROUP_RANK": "0",
            "TORCHELASTIC_RESTART_COUNT": attempt, "SHOAL_TEST_MARK": "from the launcher",
            "OMP_NUM_THREADS": "1"}
        assert seen["argv"][2] == f"rank{rank}"  # ${local_rank} substituted, as for a command
        assert seen["cwd"] == str(tmp_path)
        assert seen["path0"] == os.path.dirname(seen["argv"][0])
        assert seen["session"]  # a Ctrl-C in the terminal reaches only the launcher
        # The same as a worker started as a new process (but for the folder it writes to).
        assert seen["argv"][::2] == command[key]["argv"][::2]
        assert seen["threads"] == 1  # what the launcher set, as a new process reads it
        assert seen["policy"] == command[key]["policy"] == os.SCHED_BATCH  # (scheduling.py)
        for field in ("env", "cwd", "path0", "session", "threads"):
            assert seen[field] == command[key][field], field


def test_each_process_of_a_live_job_runs_one_thread(tmp_path):
    """Two replica groups of one process each are two processes on this node: each runs one
    thread, as 2-process DDP's do. (With a thread per core each, their LayerNorm gradients
    were summed in another order than DDP's, and the groups no longer trained DDP's model.)"""
    pytest.importorskip("torchft")
    script = tmp_path / "job_threads.py"
    script.write_text("import os, sys, torch\n"
                      "from shoal import Trainer  # (only a Trainer's script runs live)\n"
                      "group = os.environ['SHOAL_FT_GROUP']\n"
                      "path = os.path.join(sys.argv[1], 'threads_' + group)\n"
                      "open(path, 'w').write(str(torch.get_num_threads()))\n")
    result = run_shoal("run", "--replica-groups", "2", str(script), str(tmp_path),
                       env={"OMP_NUM_THREADS": None}, fork=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.read_text() for p in sorted(tmp_path.glob("threads_*"))] == ["1", "1"]
