"""Live recovery: replica groups that keep training while one of them fails and heals.

Today's default (``mode: restart``) restarts every worker from the last checkpoint after a
failure. ``mode: live`` runs the job as replica groups that meet in a quorum every step
(torchft's lighthouse and manager): a failed group is replaced and heals from a live one
while the others wait in memory (``policy: exact``) or go on without it
(``policy: available``). ``engine.py`` is the only module that imports torchft.
"""

from shoal.ft.config import FaultToleranceConfig, ReplicaPlace

__all__ = ["FaultToleranceConfig", "ReplicaPlace"]
