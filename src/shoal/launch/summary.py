"""One summary of a failed job: which rank failed first, how, and its first traceback."""

from __future__ import annotations

import glob
import os
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from shoal.launch.frames import OWN_FRAMES, PID_FILE, peer_lost
from shoal.launch.output import shoal_says
from shoal.runtime.restarts import AttemptFailure

if TYPE_CHECKING:  # rich is imported when a summary is printed: it takes 70 ms to import
    from rich.console import Console


def describe_exit(exitcode: int) -> str:
    """'exit code 3' or 'killed by SIGKILL' for a worker's exit status."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def launcher_exit_code(exitcode: int) -> int:
    """The launcher exits like a shell would for the root-cause worker."""
    if exitcode < 0:
        return 128 + (-exitcode)
    return exitcode or 1


def _stderr_log(log_dir: str, local_rank: int) -> str | None:
    paths = sorted(
        glob.glob(os.path.join(log_dir, "**", "attempt_*", str(local_rank), "stderr.log"),
                  recursive=True),
        key=os.path.getmtime,
    )
    return paths[-1] if paths else None


_OWN_FRAME = re.compile(
    r'^  File "[^"]*(?:' + "|".join(map(re.escape, OWN_FRAMES)) + r')".*\n(?:    .*\n)*',
    re.MULTILINE,
)


def strip_launcher_frames(trace: str) -> str:
    """Remove the bootstrap's own frames so the traceback starts in the user's code."""
    return _OWN_FRAME.sub("", trace + "\n").rstrip()


def _recorded_stack(failure: ProcessFailure) -> str:
    """The call stack the worker wrote to its error file ('' when it wrote none)."""
    data = failure.error_file_data
    message = data.get("message") if isinstance(data, dict) else None
    if not isinstance(message, dict):
        return ""
    return message.get("extraInfo", {}).get("py_callstack") or ""


def first_traceback(failure: ProcessFailure, log_dir: str) -> str | None:
    """The traceback recorded in the worker's error file, else the last one in its stderr log."""
    stack = _recorded_stack(failure)
    if stack:
        return strip_launcher_frames(stack)
    path = _stderr_log(log_dir, failure.local_rank)
    if path is None:
        return None
    with open(path, errors="replace") as f:
        text = f.read()
    start = text.rfind("Traceback (most recent call last)")
    return strip_launcher_frames(text[start:]) if start >= 0 else None



@dataclass(frozen=True)
class Cause:
    """How one rank ended, as the summary tells it."""

    text: str
    exit_code: int
    own: bool
    """False when the rank only failed because another did (lost peer, stopped by shoal)."""


def _recorded_message(failure: ProcessFailure) -> str:
    """The error the worker itself wrote to its error file ('' when it wrote none)."""
    data = failure.error_file_data
    message = data.get("message", "") if isinstance(data, dict) else ""
    if isinstance(message, dict):  # {"message": ..., "extraInfo": {"py_callstack": ...}}
        message = message.get("message", "")
    message = str(message or "")
    return "" if message == "<NONE>" else message  # torch's filler when there is no file


def _raised(failure: ProcessFailure, message: str) -> str:
    """'ValueError: text', or for an exception without text (a bare ``assert``) where it
    was raised: 'AssertionError at train.py:12: assert loss < 1'."""
    first = message.splitlines()[0]
    kind, _, text = first.partition(": ")
    if text.strip() or ": " not in first:
        return first
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n    ([^\n]*)',
                        _recorded_stack(failure))
    if not frames:
        return f"{kind} (no message)"
    path, line, source = frames[-1]
    return f"{kind} at {path}:{line}: {source.strip()}"


def classify(failure: ProcessFailure) -> Cause:
    """Why a rank ended: its own recorded error first, then its exit status."""
    message = _recorded_message(failure)
    if message.startswith("SystemExit: "):
        code = message.removeprefix("SystemExit: ")
        if code.lstrip("-").isdigit():
            return Cause(f"exit code {int(code) & 0xFF}", int(code) & 0xFF or 1, own=True)
        return Cause(f"exit code 1 (sys.exit: {code})", 1, own=True)
    lost = peer_lost(message)
    if lost is not None:
        return Cause(f"lost its connection to a failed rank: {lost}", 1, own=False)
    if message:
        return Cause(f"raised {_raised(failure, message)}", 1, own=True)
    if failure.exitcode == -signal.SIGTERM:
        return Cause("killed by SIGTERM (stopped by shoal after the first failure)",
                     launcher_exit_code(failure.exitcode), own=False)
    return Cause(describe_exit(failure.exitcode), launcher_exit_code(failure.exitcode), True)


def latest_attempt_dir(log_dir: str) -> str | None:
    attempts = glob.glob(os.path.join(log_dir, "**", "attempt_*"), recursive=True)
    return max(attempts, key=lambda p: int(p.rsplit("_", 1)[1]), default=None)


def collect_failures(failed: ChildFailedError, log_dir: str, first_rank: int = 0
                     ) -> dict[int, ProcessFailure]:
    """Torch's failures plus every rank that left an error file in the latest attempt.

    When one rank fails, torch may record only the first failed process it notices (often a
    rank that merely lost its peer) and stop the others; their own error files still say
    what happened to them. ``first_rank`` is this node's first global rank.
    """
    failures = dict(failed.failures)
    attempt = latest_attempt_dir(log_dir)
    if attempt is None:
        return failures
    known = {f.local_rank for f in failures.values()}
    for path in glob.glob(os.path.join(attempt, "*", "error.json")):
        local_rank = int(os.path.basename(os.path.dirname(path)))
        if local_rank in known:
            continue
        try:
            failures[first_rank + local_rank] = ProcessFailure(
                local_rank=local_rank, pid=_worker_pid(os.path.dirname(path)), exitcode=1,
                error_file=path)
        except ValueError:  # a rank stopped while it wrote its file: nothing to tell
            continue
    return failures


def _worker_pid(folder: str) -> int:
    try:
        with open(os.path.join(folder, PID_FILE)) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def root_cause(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The failure that started it: an own error before a collateral one, then the earliest."""
    return min(failures.items(),
               key=lambda item: (not classify(item[1]).own, item[1].timestamp, item[0]))


def _lost_node(message: str, nodes: Sequence[str]) -> str | None:
    """The node, of 'HOSTNAME (ADDRESS)' labels, whose address the lost connection names
    (gloo: 'Connection closed by peer [ADDRESS]:PORT')."""
    for node in nodes:
        address = node.rpartition(" (")[2].rstrip(")")
        if f"[{address}]" in message or f" {address}:" in message:
            return node
    return None


def report_failure(failed: ChildFailedError, log_dir: str, first_rank: int = 0,
                   console: Console | None = None, nodes: Sequence[str] = (),
                   earlier: Sequence[AttemptFailure] = ()) -> int:
    """Print the summary of a failed job to stderr and return the launcher's exit code.
    ``nodes``: the other nodes of a multi-node job ('HOSTNAME (ADDRESS)'), to name the one
    a rank lost its connection to. ``earlier``: the first failure of each attempt before
    the last, listed when there were restarts."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console(stderr=True, highlight=False)
    failures = collect_failures(failed, log_dir, first_rank)
    root_rank, root = root_cause(failures)
    cause = classify(root)
    lost = None if cause.own else _lost_node(_recorded_message(root), nodes)
    if lost is not None:
        cause = replace(cause, text=cause.text.replace(
            "a failed rank", f"a failed rank on node {lost}", 1))
    pid = f", pid {root.pid}" if root.pid else ""
    console.print(f"[bold red]{escape(shoal_says())}rank {root_rank} failed first[/] "
                  f"({escape(cause.text)}; local rank {root.local_rank}{pid})", markup=True,
                  soft_wrap=True)
    for rank in sorted(r for r in failures if r != root_rank):
        console.print(f"  rank {rank}: {classify(failures[rank]).text}",
                      markup=False, soft_wrap=True)
    if earlier:
        attempts = len(earlier) + 1
        console.print(f"Every attempt failed ({attempts} of {attempts}); the first failure of "
                      "each:", markup=False, soft_wrap=True)
        for attempt in earlier:
            console.print(f"  attempt {attempt.attempt}: {attempt.describe()}",
                          markup=False, soft_wrap=True)
        last = AttemptFailure(attempt=attempts, rank=root_rank, pid=root.pid,
                              cause=cause.text, exit_code=cause.exit_code, time=0.0)
        console.print(f"  attempt {attempts}: {last.describe()}", markup=False, soft_wrap=True)
    trace = first_traceback(root, log_dir)
    if trace and _recorded_message(root).startswith("SystemExit"):
        # The rank chose to exit (its own message is in its output above): where, not a
        # traceback.
        calls = re.findall(r'File "([^"]+)", line (\d+)', trace)
        if calls:
            console.print(f"  rank {root_rank} called sys.exit at {calls[-1][0]}:"
                          f"{calls[-1][1]}", markup=False, soft_wrap=True)
    elif trace:
        console.print(f"Traceback of rank {root_rank}:", style="bold")
        console.print(trace, markup=False, soft_wrap=True)
    console.print(f"Per-rank logs: {log_dir}", markup=False, soft_wrap=True)
    return cause.exit_code
