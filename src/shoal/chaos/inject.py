"""Put a schedule of faults on a running `shoal run` job.

The job's processes are found from its launcher's pid and its ``--log-dir``: every worker
of every attempt leaves a heartbeat file there (its pid and its last step; in live mode
under ``group<g>/``), the lighthouse and each replica group's launcher are the launcher's
children. Only the launcher's own descendants are ever signalled.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil

from shoal.chaos.schedule import Fault, Schedule
from shoal.runtime import heartbeat

_GROUP = re.compile(r"^group(\d+)$")
_RANK = re.compile(r"^rank(\d+)\.beat$")
_POLL_S = 0.05
_PLACE_WAIT_S = 60.0  # a worker that is being replaced: how long a fault waits for it


class JobProcesses:
    """The processes of one job: its workers by place, its lighthouse, its group
    launchers."""

    def __init__(self, launcher: int, log_dir: str | os.PathLike):
        self.launcher, self.log_dir = launcher, Path(log_dir)

    def _ours(self, pid: int) -> psutil.Process | None:
        """The process ``pid``, where it runs and descends from the launcher."""
        try:
            process = psutil.Process(pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return None
            if self.launcher in {parent.pid for parent in process.parents()}:
                return process
        except psutil.Error:
            pass
        return None

    def workers(self) -> dict[tuple[int | None, int], tuple[int, int]]:
        """(group, rank) -> (pid, last step) of each worker that runs now (its newest
        heartbeat file; the group None outside live mode)."""
        newest: dict[tuple[int | None, int], tuple[float, Path]] = {}
        for path in self.log_dir.glob("**/heartbeats/rank*.beat"):
            rank = _RANK.match(path.name)
            if rank is None:
                continue
            groups = [int(m.group(1)) for part in path.parts if (m := _GROUP.match(part))]
            place = (groups[-1] if groups else None, int(rank.group(1)))
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            if place not in newest or mtime > newest[place][0]:
                newest[place] = (mtime, path)
        found = {}
        for place, (_, path) in newest.items():
            beat = heartbeat.read(str(path))
            if beat is not None and self._ours(beat[2]) is not None:
                found[place] = (beat[2], beat[1])
        return found

    def step(self) -> int:
        """The furthest step a running worker has taken (-1: none yet)."""
        return max((step for _, step in self.workers().values()), default=-1)

    def lighthouse(self) -> int | None:
        try:
            children = psutil.Process(self.launcher).children()
        except psutil.Error:
            return None
        for child in children:
            try:
                if any("shoal.ft.lighthouse" in part for part in child.cmdline()):
                    return child.pid
            except psutil.Error:
                continue
        return None

    def group_launcher(self, group: int | None) -> int | None:
        """The launcher of replica group ``group``: the launcher's child that a worker of
        the group descends from."""
        for (g, _), (pid, _) in self.workers().items():
            if g != group:
                continue
            process = self._ours(pid)
            chain = [process, *process.parents()] if process is not None else []
            for child, parent in zip(chain, chain[1:], strict=False):
                if parent.pid == self.launcher:
                    return child.pid
        return None

    def running(self) -> bool:
        return psutil.pid_exists(self.launcher) and self._status() != psutil.STATUS_ZOMBIE

    def _status(self) -> str | None:
        try:
            return psutil.Process(self.launcher).status()
        except psutil.Error:
            return None


class Chaos:
    """A thread that carries ``schedule`` out on ``job``; ``log`` says what it did."""

    def __init__(self, schedule: Schedule, job: JobProcesses, last_step: int | None = None):
        """``last_step``: the job's last step, for an ``after_end`` fault."""
        self.schedule, self.job, self.last_step = schedule, job, last_step
        self.log: list[str] = []
        self.fired: list[Fault] = []
        """The faults carried out (a fault that found nothing to strike is not)."""
        self._done = threading.Event()
        self._stopped: list[int] = []  # pids under SIGSTOP, to be let go
        self._thread = threading.Thread(target=self._run, daemon=True, name="shoal-chaos")
        self._started = 0.0

    def start(self) -> Chaos:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the schedule where it is; every process it stopped goes on."""
        self._done.set()
        self._thread.join(timeout=10)
        for pid in self._stopped:
            self._signal(pid, signal.SIGCONT)

    def __enter__(self) -> Chaos:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _wait(self, until, timeout: float | None = None) -> bool:
        """Poll ``until()`` while the job runs: whether it came true."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set() and self.job.running():
            if until():
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            self._done.wait(_POLL_S)
        return False

    def _say(self, message: str) -> None:
        self.log.append(f"{time.monotonic() - self._started:6.2f} s: {message}")

    def _run(self) -> None:
        if not self._wait(lambda: self.job.step() >= 1):
            return
        self._started = time.monotonic()
        for fault in self.schedule.faults:
            if fault.kind == "after_end":
                if self.last_step is None or not self._wait(
                        lambda: self.job.step() >= self.last_step):
                    continue
            elif not self._wait(lambda fault=fault: time.monotonic() - self._started
                                >= fault.at):
                return
            self._strike(fault)

    def _strike(self, fault: Fault) -> None:
        if fault.kind == "lighthouse":
            pid = self.job.lighthouse()
            if pid is None:
                self._say(f"{fault}: no lighthouse")
                return
        elif fault.kind == "launcher":
            found: list[int | None] = [None]

            def launcher() -> bool:
                found[0] = self.job.group_launcher(fault.group)
                return found[0] is not None
            if not self._wait(launcher, _PLACE_WAIT_S):
                self._say(f"{fault}: no such launcher running")
                return
            pid = found[0]
        else:
            place = (fault.group, fault.rank or 0)
            worker: list[int | None] = [None]

            def there() -> bool:  # (read once: a worker may end between two reads)
                worker[0] = (self.job.workers().get(place) or [None])[0]
                return worker[0] is not None
            if not self._wait(there, _PLACE_WAIT_S):
                self._say(f"{fault}: no worker there")
                return
            pid = worker[0]
        assert pid is not None
        step = self.job.step()
        if fault.kind == "stop":
            self._signal(pid, signal.SIGSTOP)
            self._stopped.append(pid)
            threading.Timer(fault.seconds, self._let_go, (pid,)).start()
        else:
            self._signal(pid, signal.SIGKILL)
        self.fired.append(fault)
        self._say(f"{fault} (pid {pid}, job at step {step})")

    def _let_go(self, pid: int) -> None:
        if pid in self._stopped:
            self._stopped.remove(pid)
            self._signal(pid, signal.SIGCONT)

    def _signal(self, pid: int, signum: int) -> None:
        if self.job._ours(pid) is not None:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


class ChaosRun:
    """How a job ran under a schedule: its exit status (None: it outlived ``timeout`` and
    was killed), its output, what the schedule did (``log``, and the faults ``fired``), and
    how long it took."""

    def __init__(self, returncode: int | None, output: str, log: list[str],
                 fired: list[Fault], seconds: float):
        self.returncode, self.output, self.log = returncode, output, log
        self.fired, self.seconds = fired, seconds

    @property
    def ended(self) -> bool:
        """It ended by itself, well."""
        return self.returncode == 0


def run_under(schedule: Schedule, command: list[str], log_dir: str | os.PathLike, *,
              last_step: int | None = None, timeout: float = 600.0,
              env: dict[str, str] | None = None, cwd: str | None = None) -> ChaosRun:
    """Run ``command`` (a `shoal run` or `shoal train` with ``--log-dir LOG_DIR``) with
    ``schedule`` put on it; its output (stdout and stderr) is kept."""
    import subprocess
    import tempfile

    started = time.monotonic()
    with tempfile.TemporaryFile() as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   cwd=cwd)
        with Chaos(schedule, JobProcesses(process.pid, log_dir), last_step) as chaos:
            try:
                code: int | None = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
                _kill_tree(process.pid)
                process.wait()
        out.seek(0)
        output = out.read().decode(errors="replace")
    return ChaosRun(code, output, chaos.log, chaos.fired, time.monotonic() - started)


def _kill_tree(pid: int) -> None:
    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return
    for process in tree:
        try:
            process.kill()
        except psutil.Error:
            pass
