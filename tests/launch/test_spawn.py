"""shoal.spawn forks its processes from a server that has imported torch once: each process
still gets the caller's environment and working directory as they are at the call."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import shoal
from tests.helpers import REPO

MARK = "SHOAL_TEST_SPAWN_MARK"
# Where shoal.spawn forks from a server (elsewhere it spawns: nothing to test of a server).
FORKED = pytest.mark.skipif(sys.platform != "linux", reason="processes are forked on Linux only")


def _seen() -> tuple:
    preloaded = "torch._dynamo" in sys.modules  # before this process imported anything
    shoal.init("gloo")
    return (shoal.rank(), os.environ.get("WORLD_SIZE"), os.environ.get(MARK), os.getcwd(),
            preloaded)


def test_every_call_gets_the_callers_environment_as_it_is_then(tmp_path, monkeypatch):
    monkeypatch.setenv(MARK, "first")
    first = shoal.spawn(_seen, nprocs=2)
    monkeypatch.setenv(MARK, "second")
    monkeypatch.chdir(tmp_path)
    second = shoal.spawn(_seen, nprocs=2)
    monkeypatch.delenv(MARK)
    third = shoal.spawn(_seen, nprocs=3)
    assert [r[:3] for r in first] == [(0, "2", "first"), (1, "2", "first")]
    assert [r[:3] for r in second] == [(0, "2", "second"), (1, "2", "second")]
    assert [r[:3] for r in third] == [(0, "3", None), (1, "3", None), (2, "3", None)]
    assert {r[3] for r in second + third} == {str(tmp_path)}
    if sys.platform == "linux":
        assert all(r[4] for r in first + second + third), "torch was not preloaded"


# A caller that was itself launched (RANK, WORLD_SIZE... in its environment when the server
# starts), then drops those variables: elastic's values for the workers must still win. And
# a forkserver that other code started first, without shoal's preload: the caller's
# environment as it is at the call still reaches the workers.
CALLERS = """
import multiprocessing, os
import shoal
from tests.launch.test_spawn import MARK, _seen
launched = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
os.environ[MARK] = "old"
if os.environ["WHO_STARTS_THE_SERVER"] == "others":
    p = multiprocessing.get_context("forkserver").Process(target=os.getpid)
    p.start()
    p.join()
else:
    os.environ.update(launched)
    shoal.spawn(_seen, nprocs=1)
    for key in launched:
        del os.environ[key]
os.environ[MARK] = "new"
print(sorted(r[:3] for r in shoal.spawn(_seen, nprocs=2)))
"""


@FORKED
@pytest.mark.parametrize("who", ["shoal", "others"])
def test_a_server_started_in_another_environment(who):
    env = {**os.environ, "WHO_STARTS_THE_SERVER": who, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CALLERS], cwd=REPO, env=env, timeout=120,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == str([(0, "2", "new"), (1, "2", "new")])


@FORKED
def test_the_processes_are_forked_from_one_server():
    parents = {tuple(shoal.spawn(os.getppid, nprocs=2)) for _ in range(2)}
    assert len(parents) == 1  # both calls, both ranks: one parent
    (parent,) = {p for pair in parents for p in pair}
    assert parent != os.getpid()
