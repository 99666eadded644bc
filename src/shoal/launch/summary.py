"""One summary of a failed job: which rank failed first, how, and its first traceback."""

from __future__ import annotations

import glob
import os
import re
import signal

from rich.console import Console
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure


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
    r'^  File "[^"]*(shoal/launch/worker\.py|<frozen runpy>|/runpy\.py|'
    r'elastic/multiprocessing/errors/__init__\.py)".*\n(?:    .*\n)*',
    re.MULTILINE,
)


def strip_launcher_frames(trace: str) -> str:
    """Remove the bootstrap's own frames so the traceback starts in the user's code."""
    return _OWN_FRAME.sub("", trace + "\n").rstrip()


def first_traceback(failure: ProcessFailure, log_dir: str) -> str | None:
    """The traceback recorded in the worker's error file, else the last one in its stderr log."""
    data = failure.error_file_data
    if isinstance(data, dict):
        message = data.get("message")
        if isinstance(message, dict):
            stack = message.get("extraInfo", {}).get("py_callstack")
            if stack:
                return strip_launcher_frames(stack)
    path = _stderr_log(log_dir, failure.local_rank)
    if path is None:
        return None
    with open(path, errors="replace") as f:
        text = f.read()
    start = text.rfind("Traceback (most recent call last)")
    return strip_launcher_frames(text[start:]) if start >= 0 else None


def report_failure(failed: ChildFailedError, log_dir: str, console: Console | None = None) -> int:
    """Print the summary of a failed job to stderr and return the launcher's exit code."""
    console = console or Console(stderr=True, highlight=False)
    root_rank, root = failed.get_first_failure()
    console.print(
        f"[bold red]shoal: rank {root_rank} failed first[/] ({describe_exit(root.exitcode)}, "
        f"local rank {root.local_rank}, pid {root.pid})"
    )
    for rank in sorted(r for r in failed.failures if r != root_rank):
        other = failed.failures[rank]
        note = " (stopped by shoal after the first failure)" if other.exitcode == -15 else ""
        console.print(f"  rank {rank}: {describe_exit(other.exitcode)}{note}")
    trace = first_traceback(root, log_dir)
    if trace:
        console.print(f"Traceback of rank {root_rank}:", style="bold")
        console.print(trace, markup=False, soft_wrap=True)
    console.print(f"Per-rank logs: {log_dir}")
    return launcher_exit_code(root.exitcode)
