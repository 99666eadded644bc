"""``Comm``: what a parallel strategy's communication does at the loop's points, as the
Harness meets it (one interface, whatever the strategy: DDP's all-reduce and its
compression hooks, ZeRO, FSDP, the periodic averaging of local_sgd and diloco, a live
job's gradients across replica groups)."""

from __future__ import annotations

from typing import Any


class Comm:
    """A strategy's communication; every method is a no-op by default (plain DDP on one
    process: nothing travels)."""

    def after_backward(self) -> None:
        """After a backward whose gradients were synchronized (not inside ``no_sync``):
        count what it sent."""

    def after_step(self) -> None:
        """After each optimizer step (local_sgd and diloco meet every few steps)."""

    def synchronize(self) -> None:
        """Where replicas that train apart must end as one (an epoch's end, the run's)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (error feedback, a replica's outer state)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """What ``state_dict`` gave."""
