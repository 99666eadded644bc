"""``shoal.Tracker``: where rank 0 logs a run besides metrics.jsonl (the interface; the
built-in trackers and how a run opens them: ``shoal.metrics.trackers``)."""

from __future__ import annotations

from typing import Any, ClassVar


class Tracker:
    """A place rank 0 logs the run to. Subclass it and override what your tracker needs;
    every method is a no-op by default. Name one in ``trainer.metrics.trackers`` by import
    path ('mymodule:MyTracker', or ``{builder, args}``), or give objects to
    ``shoal.Trainer(trackers=[...])``.

    A tracker must not raise out of a method during training: a tracker that cannot reach
    its service says so in one line and stops logging, and the run goes on.

    Never raises.
    """

    name: ClassVar[str] = "tracker"
    """Key of its run id among a checkpoint's (``<name>_run_id``)."""

    def start(self, params: dict[str, Any], run_name: str | None,
              resume_id: str | None) -> str | None:
        """Open the run: a new one logging ``params`` (the resolved run config), or the one
        ``resume_id`` names continued (a restart or a resume). Returns the run's id, kept to
        continue it (None: nothing to continue). Never raises."""
        return None

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        """Figures at ``step`` (finite numbers only): each step's ``train/...`` and
        ``time/...``, each window's ``rank<r>/...``, each validation's. Never raises."""

    def flush(self) -> None:
        """The end of a metrics window (every ``metrics.every`` steps): send what is
        pending. Never raises."""

    def wait(self) -> None:
        """Before a checkpoint: until what was logged so far is sent. Never raises."""

    def log_text(self, text: str, name: str) -> None:
        """A text file of the run (the end-of-run table, ``summary.txt``). Never raises."""

    def log_dict(self, data: dict[str, Any], name: str) -> None:
        """A JSON file of the run (the final metrics, ``metrics.json``). Never raises."""

    def finish(self, status: str) -> None:
        """End the run: 'FINISHED', 'FAILED' (an error) or 'KILLED' (an exit or
        interrupt). Never raises."""
