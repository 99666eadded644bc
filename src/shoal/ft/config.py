"""The live-recovery settings (``trainer.fault_tolerance``) and a worker's place among the
replica groups, read once from what the launcher set."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shoal.errors import usage_error

# What the launcher tells each worker of a live job (read here, and nowhere else).
ENV_CONFIG = "SHOAL_FT_CONFIG"
ENV_GROUP = "SHOAL_FT_GROUP"
ENV_LIGHTHOUSE = "SHOAL_FT_LIGHTHOUSE"
ENV_HOST = "SHOAL_FT_HOST"
# What a worker sets in its own environment once it opens a live session (a script that
# ends without one trained its group apart from the others: ``shoal.launch.worker``).
ENV_OPENED = "SHOAL_FT_OPENED"


# Settings that only the workers read: a Trainer may set them itself under `shoal run`.
WORKERS_OWN = ("compression_state_every", "compression_state_share", "quorum_every_s")


class FaultToleranceConfig(BaseModel):
    """How a job lives through the failure of a worker (``trainer.fault_tolerance``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mode: Literal["restart", "live"] = "restart"
    """'restart': the elastic agent stops every worker and starts them all again from the
    last checkpoint (with ``--max-restarts``). 'live': the job is replica groups meeting in
    a quorum every step; only the failed group restarts, and it heals from a live one."""
    policy: Literal["exact", "available"] = "exact"
    """Live mode only. 'exact': the other groups wait in memory until the replacement has
    healed, and the interrupted step is done again: the run ends bitwise equal to one without
    failures. 'available': the other groups go on without the missing one (its samples of
    those steps are skipped, said and counted) and the replacement joins when healed."""
    replica_groups: int | None = Field(None, ge=1)
    """Replica groups on each node (``--replica-groups``), each its own agent, workers and
    restarts. Default: one per node. (The launcher hands its workers the job's total.)"""
    lighthouse: str | None = None
    """Address of a running torchft lighthouse (http://HOST:PORT). Default: the launcher of
    node 0 starts one for the job and stops it at the end."""
    heartbeat_timeout_ms: int = Field(250, gt=0)
    """The lighthouse drops a group whose manager has not beaten for this long (a manager
    beats three times in it): how fast a dead or frozen group is noticed. After a kill the
    next quorum forms once the dead group's beats have run out, as its replacement joins
    under a new id: this is most of the survivors' pause (500 ms made it about 0.5 s)."""
    join_timeout_ms: int = Field(500, gt=0)
    """How long the lighthouse waits for the groups of the last quorum before forming a new
    one without those that are missing."""
    step_timeout_s: float = Field(10.0, gt=0)
    """The longest a collective across groups or a heal transfer may take before the step
    is given up (and done again). A group of several processes votes on the step within
    twice this: its other processes may each still be in a collective."""
    replacement_timeout_s: float = Field(120.0, gt=0)
    """Policy 'exact': how long the other groups wait for a replacement before they give up
    and fall back to the restart from the last checkpoint."""
    quorum_every_s: float = Field(5.0, gt=0)
    """A step after one that committed with every group in it reuses that quorum, without
    a round trip to the lighthouse (a lost group makes the next step's collective fail,
    and the step done again holds a full quorum). The groups hold a full quorum at least
    this often: how long a replacement under 'available' may wait to be let in, and how
    soon a lighthouse that is gone is noticed. (A full quorum costs a few milliseconds to
    tens of milliseconds here: 0.5 s made `examples/gpt.yaml`'s 0.33 s steps 3 to 6 %
    slower.) A group of several processes counts it in steps, agreed inside the group at
    each full quorum from the pace of the steps before it, so that all its processes ask at
    the same step: a stretch of slower steps (a validation pass) comes on top."""
    compression_state_every: int = Field(10, ge=1)
    """Policy 'exact' with compression powersgd or topk, whose error feedback each rank keeps
    for itself: every this many steps each group hands the others its compression state, and
    each keeps the averaged gradients of the steps since. A replacement starts again from
    there and redoes those steps alone while the others wait. Larger: fewer hand-overs, one
    more gradient kept per step (in host memory), a longer redo."""
    compression_state_share: float = Field(0.01, gt=0, le=1)
    """Policy 'exact' with compression powersgd or topk: the most of the run's time that
    hand-overs may take. A hand-over comes after at least ``compression_state_every``
    steps, and no sooner than the last one's time divided by this share after it (0.01:
    a hundred times as long as a hand-over takes), so that steps much shorter than a
    hand-over do not pay for one every few steps; the redo grows to match (paid only when
    a group is replaced). 1: every ``compression_state_every`` steps, as groups of several
    processes always hand over (their processes must agree on the step without a word).
    (A hand-over's time is that of its own work; its copies slow the step it comes in
    about as much again.)"""

    @model_validator(mode="after")
    def _ordered_timeouts(self) -> FaultToleranceConfig:
        # A group must be noticed as gone before a step across groups gives up on it.
        if self.heartbeat_timeout_ms / 1000 >= self.step_timeout_s:
            raise ValueError(f"heartbeat_timeout_ms {self.heartbeat_timeout_ms} must be "
                             f"shorter than step_timeout_s {self.step_timeout_s}")
        if self.step_timeout_s >= self.replacement_timeout_s:
            raise ValueError(f"step_timeout_s {self.step_timeout_s} must be shorter than "
                             f"replacement_timeout_s {self.replacement_timeout_s}")
        return self

    def with_workers_own(self, own: FaultToleranceConfig) -> FaultToleranceConfig:
        """These settings (the launcher's), with those that only the workers read taken from
        ``own`` (a Trainer's ``fault_tolerance``) where it sets them."""
        return self.model_copy(update={key: getattr(own, key) for key in WORKERS_OWN
                                       if key in own.model_fields_set})

    def overruled(self, own: FaultToleranceConfig) -> str | None:
        """A line naming what ``own`` (a Trainer's ``fault_tolerance``) sets otherwise than
        these settings (the launcher's, which win), or None."""
        # (replica_groups: the Trainer's is per node, the launcher hands its the job's total)
        keys = sorted(key for key in own.model_fields_set - {*WORKERS_OWN, "replica_groups"}
                      if getattr(own, key) != getattr(self, key))
        if not keys:
            return None
        given = ", ".join(f"{key} {getattr(own, key)!r} (runs with {getattr(self, key)!r})"
                          for key in keys)
        return (f"the Trainer's fault_tolerance sets {given}: the launcher's settings win "
                "(its flags, or the run config's trainer.fault_tolerance)")

    @property
    def live(self) -> bool:
        return self.mode == "live"

    @property
    def default_hang_timeout_s(self) -> float:
        """A live job's ``--hang-timeout`` unless one is given: a group silent for half the
        replacement timeout is taken as frozen (its agent kills and restarts it), which
        leaves the other half for its restart and heal before the others give up on it."""
        return self.replacement_timeout_s / 2

    @classmethod
    def build(cls, **settings: object) -> FaultToleranceConfig:
        try:
            return cls(**settings)
        except ValidationError as exc:
            raise usage_error(exc, "fault_tolerance") from None


@dataclass(frozen=True)
class ReplicaPlace:
    """Where this worker's group stands in a live job, as its launcher said."""

    group: int
    """This replica group's index."""
    groups: int
    """How many replica groups the job has."""
    lighthouse: str
    """The lighthouse's address."""
    config: FaultToleranceConfig
    """The job's live-recovery settings (the launcher's, which the flags chose)."""
    host: str = "127.0.0.1"
    """The address the other groups reach this group's manager and heal server at."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ReplicaPlace | None:
        env = os.environ if environ is None else environ
        if ENV_GROUP not in env:
            return None
        config = FaultToleranceConfig.build(**json.loads(env[ENV_CONFIG]))
        return cls(group=int(env[ENV_GROUP]), groups=config.replica_groups or 1,
                   lighthouse=env[ENV_LIGHTHOUSE], config=config,
                   host=env.get(ENV_HOST, "127.0.0.1"))

    def environ(self) -> dict[str, str]:
        """The variables that give a group's workers this place."""
        return {ENV_GROUP: str(self.group), ENV_LIGHTHOUSE: self.lighthouse,
                ENV_CONFIG: self.config.model_dump_json(), ENV_HOST: self.host}
