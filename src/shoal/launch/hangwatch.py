"""The launcher's hang watch: no rank made progress for too long, so say where each one is.

A thread in the launcher reads the ranks' heartbeats (see shoal.runtime.heartbeat). When the
newest beat of any rank is older than the timeout, it asks every rank for its stacks, prints
one report (who is inside which collective, who is elsewhere and where), and kills the
workers, so the job ends instead of waiting forever.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shoal.launch.output import shoal_says
from shoal.runtime import heartbeat

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_COLLECTIVE_FILE = "torch/distributed/distributed_c10d.py"
_LIBRARY = ("/torch/", "/shoal/", "/site-packages/", "<frozen", "/threading.py")


@dataclass
class RankPosition:
    rank: int
    step: int
    collective: str | None
    where: str
    stopped: bool = False
    """The process is stopped (SIGSTOP, a debugger): it cannot dump its stack."""

    def describe(self) -> str:
        if self.stopped:
            return (f"rank {self.rank}: stopped (SIGSTOP or a debugger), its stack unreadable "
                    f"(last step {self.step})")
        if self.collective:
            return (f"rank {self.rank}: inside {self.collective} at {self.where} "
                    f"(waiting for the other ranks; last step {self.step})")
        return f"rank {self.rank}: not in a collective, at {self.where} (last step {self.step})"


def main_thread_frames(dump: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of the dumped main thread, most recent first."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
    # faulthandler runs in the main thread: its block is 'Current thread', else the last.
    block = next((b for b in reversed(blocks) if b.startswith("Current thread")), blocks[-1])
    frames = []
    for line in block.splitlines():
        found = _FRAME.match(line)
        if found:
            frames.append((found["file"], int(found["line"]), found["func"]))
    return frames


def locate(rank: int, step: int, dump: str) -> RankPosition:
    frames = main_thread_frames(dump)
    collective = next((func for file, _, func in frames
                       if file.replace(os.sep, "/").endswith(_COLLECTIVE_FILE)
                       and not func.startswith("_")), None)
    if collective is None and any(func == "backward" for _, _, func in frames):
        collective = "backward (DDP's gradient all-reduce)"
    user = next(((f, n, fn) for f, n, fn in frames if not any(p in f for p in _LIBRARY)),
                frames[0] if frames else ("?", 0, "?"))
    return RankPosition(rank, step, collective, f"{user[0]}:{user[1]} in {user[2]}")


def report(positions: list[RankPosition], timeout: float) -> str:
    outside = [p for p in positions if p.collective is None]
    inside = [p for p in positions if p.collective is not None]
    lines = [f"{shoal_says()}hang: no rank made progress for {timeout:g} s"]
    kinds = {p.collective for p in inside if p.collective is not None}
    if outside and inside:
        lines.append("  stuck: rank " + ", ".join(str(p.rank) for p in outside)
                     + " (not in a collective while the others wait in one)")
    elif len(kinds) > 1:
        lines.append("  mismatch: ranks wait in different collectives ("
                     + ", ".join(sorted(kinds)) + ")")
    lines.extend("  " + p.describe() for p in sorted(positions, key=lambda p: p.rank))
    return "\n".join(lines)


class HangWatch(threading.Thread):
    """Watches the heartbeats of this node's ranks; on a hang, reports and kills them.

    The ranks are found from their beat files: under elastic rendezvous a node learns its
    global ranks only when the workers start, and they may change at each restart.
    ``network(seconds)`` names the nodes not heard from for that long (multi-node jobs).
    """

    def __init__(self, directory: str, local_ranks: int, timeout: float, poll: float = 0.5,
                 network: Callable[[float], list[str]] | None = None):
        super().__init__(daemon=True, name="shoal-hang-watch")
        self.directory = directory
        self.local_ranks = local_ranks
        self.timeout = timeout
        self.poll = poll
        self.network = network
        self.report: str | None = None
        self._stopping = threading.Event()
        self._killed: set[int] = set()  # pids already diagnosed (a restart brings new ones)

    def stop(self) -> None:
        self._stopping.set()

    def _live_beats(self) -> dict[int, tuple[float, int, int]]:
        """rank -> beat, for the ranks whose process is alive and not yet diagnosed."""
        beats = {}
        for path in glob.glob(os.path.join(self.directory, "rank*.beat")):
            beat = heartbeat.read(path)
            if beat is None or beat[2] in self._killed or not _alive(beat[2]):
                continue
            beats[int(os.path.basename(path)[4:-5])] = beat
        return beats

    def run(self) -> None:
        while not self._stopping.wait(self.poll):
            beats = self._live_beats()
            if len(beats) < self.local_ranks:
                continue  # not all ranks started (or a restart is under way)
            if not any(step >= 0 for _, step, _ in beats.values()):
                continue  # not armed: no rank has beaten yet
            newest = max(t for t, _, _ in beats.values())
            if time.time() - newest > self.timeout:
                self._diagnose(beats)

    def _diagnose(self, beats: dict[int, tuple[float, int, int]]) -> None:
        for rank, (_, _, pid) in beats.items():
            open(heartbeat.stack_path(self.directory, rank), "w").close()
            _signal(pid, heartbeat.STACK_SIGNAL)
        time.sleep(1.0)  # the dumps are written by a C handler, almost at once
        positions = []
        for rank, (_, step, pid) in beats.items():
            with open(heartbeat.stack_path(self.directory, rank), errors="replace") as f:
                position = locate(rank, step, f.read())
            position.stopped = _stopped(pid)
            positions.append(position)
        text = report(positions, self.timeout)
        lost = self.network(max(2.0, min(self.timeout / 2, 5.0))) if self.network else []
        if lost:
            text += "\n  network: " + "\n  network: ".join(lost)
        self.report = self.report or text
        print(text, file=sys.stderr, flush=True)
        for _, _, pid in beats.values():
            self._killed.add(pid)
            _signal(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc; False where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
