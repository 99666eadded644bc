"""shoal.spawn forks its processes from a server that has imported torch once: each process
still gets the caller's environment and working directory as they are at the call."""

from __future__ import annotations

import multiprocessing
import os
import sys

import pytest

import shoal

MARK = "SHOAL_TEST_SPAWN_MARK"


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
    if "forkserver" in multiprocessing.get_all_start_methods():
        assert all(r[4] for r in first + second + third), "torch was not preloaded"


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(),
                    reason="no forkserver on this platform")
def test_the_processes_are_forked_from_one_server():
    parents = {tuple(shoal.spawn(os.getppid, nprocs=2)) for _ in range(2)}
    assert len(parents) == 1  # both calls, both ranks: one parent
    (parent,) = {p for pair in parents for p in pair}
    assert parent != os.getpid()
