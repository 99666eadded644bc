"""Progress display on rank 0: a live bar on a terminal, periodic lines in a log."""

from __future__ import annotations

import sys
import time


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Shows step, loss and samples/s. Disabled: every method does nothing."""

    def __init__(self, total_steps: int | None, enabled: bool, line_interval: float = 2.0,
                 live_interval: float = 0.2):
        self.enabled = enabled
        self.total = total_steps
        # Each refresh reads the loss, which waits for the GPU: refresh on a clock, not a step.
        self.interval = live_interval if enabled and sys.stdout.isatty() else line_interval
        self._live = None
        self._last_update = 0.0
        if enabled and sys.stdout.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._live = RichProgress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
            )
            self._task = self._live.add_task("train", total=total_steps, stats="")
            self._live.start()
        self._start = time.perf_counter()

    def wants_update(self) -> bool:
        """True when a refresh is due; lets the caller skip reading the loss otherwise."""
        if not self.enabled:
            return False
        return time.perf_counter() - self._last_update >= self.interval

    def update(self, step: int, epoch: int, loss: float, samples_per_s: float) -> None:
        if not self.enabled:
            return
        stats = f"epoch {epoch} · loss {loss:.4f} · {samples_per_s:,.0f} samples/s"
        self._last_update = time.perf_counter()
        if self._live is not None:
            self._live.update(self._task, completed=step, stats=stats)
            return
        print(self._line(step, stats), flush=True)

    def _line(self, step: int, stats: str) -> str:
        if not self.total:
            return f"step {step} · {stats}"
        width = 24
        done = min(step / self.total, 1.0)
        bar = "#" * int(done * width) + "-" * (width - int(done * width))
        elapsed = time.perf_counter() - self._start
        eta = elapsed / done - elapsed if done > 0 else 0.0
        return f"[{bar}] {done:4.0%} {step}/{self.total} · {stats} · eta {_fmt_eta(eta)}"

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
