"""What a rank prints and how its end is told: paths as under `python`, a rank prefix on
every line, whole summary lines, a message-less exception told by where it was raised, a
real pid."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shoal.launch.worker_start import FORK_FIRST_ENV
from tests.helpers import REPO, run_shoal

SCRIPT = textwrap.dedent("""\
    import os, sys, time
    mode, rank = sys.argv[1], os.environ["RANK"]
    print(f"rank {rank} runs {__file__}")
    if rank == "0":
        open("printed", "w").close()
    if rank == "1":
        while not os.path.exists("printed"):  # rank 0's line is out before rank 1 fails
            time.sleep(0.01)
        if mode == "long":
            raise RuntimeError("a message longer than a line: " + "word " * 60 + "end")
        if mode == "message":
            sys.exit("the script gave up")
        if mode == "assert":
            x = 1
            assert x == 2
""")


@pytest.fixture
def script(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    return tmp_path


@pytest.mark.timeout(120)
def test_paths_are_absolute_and_summary_lines_whole(script):
    # Started by a relative path, as `python job.py` would be.
    out = run_shoal("run", "--nproc-per-node", "2", "job.py", "long", cwd=str(script))
    assert out.returncode == 1, out.stderr
    assert f"[rank0]: rank 0 runs {script}/job.py" in out.stdout
    assert f'[rank1]:   File "{script}/job.py", line 10, in <module>' in out.stderr
    first = next(line for line in out.stderr.splitlines() if "failed first" in line)
    assert first.startswith("shoal: rank 1 failed first (raised RuntimeError: a message "
                            "longer than a line: word")
    assert re.search(r"word end; local rank 1, pid [1-9]\d*\)$", first), first


@pytest.mark.timeout(120)
@pytest.mark.parametrize("forked", [False, True], ids=["new-processes", "forked"])
def test_a_sys_exit_message_is_the_rank_s_own_line(script, forked):
    # Forked: as a restarted worker (or a live group's) is, from the first attempt on.
    env = {FORK_FIRST_ENV: "1"} if forked else {}
    out = run_shoal("run", "--nproc-per-node", "2", "job.py", "message", cwd=str(script),
                    env=env)
    assert out.returncode == 1, out.stderr
    assert "[rank1]: the script gave up\n" in out.stderr
    assert "\nthe script gave up" not in out.stderr  # no line without its rank
    assert "shoal: rank 1 failed first (exit code 1 (sys.exit: the script gave up)" \
        in out.stderr


@pytest.mark.timeout(120)
def test_an_assert_without_message_says_where(script):
    out = run_shoal("run", "--nproc-per-node", "2", "job.py", "assert", cwd=str(script))
    assert out.returncode == 1, out.stderr
    assert re.search(rf"shoal: rank 1 failed first \(raised AssertionError at {script}/job.py:"
                     r"15: assert x == 2; local rank 1, pid [1-9]\d*\)", out.stderr), out.stderr


ALTERNATING = textwrap.dedent("""\
    import sys, time
    for i in range(6):
        print(f"line {i} to stdout")
        time.sleep(0.03)
        print(f"line {i} to stderr", file=sys.stderr)
        time.sleep(0.03)
    print("no line end at the last", end="")
""")


@pytest.mark.timeout(120)
def test_a_rank_s_stdout_and_stderr_come_in_the_order_written(tmp_path):
    script = tmp_path / "alternate.py"
    script.write_text(ALTERNATING)
    out = subprocess.run([sys.executable, "-m", "shoal", "run", "--nproc-per-node", "1",
                          str(script)], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=100,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout
    lines = [line for line in out.stdout.splitlines() if line.startswith("[rank0]: ")]
    assert lines == [f"[rank0]: line {i} to {stream}" for i in range(6)
                     for stream in ("stdout", "stderr")] + ["[rank0]: no line end at the last"]


def test_the_relay_follows_a_new_attempt_and_shows_the_last_one_whole_first(tmp_path):
    # Looks made by hand, one after another, as the relay's thread makes them every 20 ms:
    # a file is read when it grew; a restart's new attempt is listed as soon as its folder
    # is there, after the rest of the attempt before (its last line without its end too).
    import io

    from shoal.launch.output import OutputRelay

    def attempt(n: int) -> Path:
        folder = tmp_path / "run" / f"attempt_{n}" / "0"
        folder.mkdir(parents=True)
        return folder

    def write(folder: Path, stream: str, text: str) -> None:
        with open(folder / f"{stream}.log", "a") as f:
            f.write(text)

    out, err = io.StringIO(), io.StringIO()
    relay = OutputRelay(str(tmp_path), lambda rank: {"stdout", "stderr"}, out=out, err=err)
    relay._look()  # nothing yet
    first = attempt(0)
    write(first, "stdout", "one\n")
    relay._look()
    write(first, "stdout", "two\nthree without its end")
    write(first, "stderr", "failed\n")
    relay._look()
    assert out.getvalue() == "[rank0]: one\n[rank0]: two\n"
    assert err.getvalue() == "[rank0]: failed\n"
    second = attempt(1)
    write(second, "stdout", "again\n")
    relay._look()
    assert out.getvalue() == ("[rank0]: one\n[rank0]: two\n[rank0]: three without its end\n"
                              "[rank0]: again\n")


@pytest.mark.timeout(60)
def test_an_idle_relay_waits_for_a_write_instead_of_looking_every_20_ms(tmp_path):
    # While nothing is written the relay's thread sleeps until a file is (inotify), or a
    # tenth of a second: a launcher beside busy workers takes a slice of their cores at each
    # look. A write is then shown, and the relay stops at once.
    import io

    from shoal.launch.output import OutputRelay

    folder = tmp_path / "run" / "attempt_0" / "0"
    folder.mkdir(parents=True)
    (folder / "stdout.log").write_text("")
    out, err = io.StringIO(), io.StringIO()
    relay = OutputRelay(str(tmp_path), lambda rank: {"stdout", "stderr"}, out=out, err=err)
    if relay._writes is None:
        pytest.skip("no inotify here")
    looks = []
    look = relay._look

    def counted(final: bool = False) -> bool:
        looks.append(final)
        return look(final)

    relay._look = counted
    relay.start()
    try:
        time.sleep(1.0)
        idle = len(looks)
        with open(folder / "stdout.log", "a") as f:
            f.write("written\n")
        while "written" not in out.getvalue():  # (the test's timeout guards a hang)
            time.sleep(0.005)
    finally:
        relay.stop()
    assert not relay.is_alive()
    assert 1 <= idle <= 20, idle  # (a look every 20 ms: about 50)
    assert out.getvalue() == "[rank0]: written\n"
