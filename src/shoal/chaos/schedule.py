"""A seeded schedule of faults at random moments: what happens to a job, and when.

A schedule is drawn from a seed alone, so a failing schedule replays exactly: the same
kinds of fault, at the same moments after the job's first step, on the same places (a
replica group and rank, not a pid: a pid changes with every restart).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

KINDS = ("kill", "stop", "lighthouse", "launcher", "after_end")
"""SIGKILL of a worker; SIGSTOP of a worker for a few seconds, then SIGCONT; SIGKILL of a
live job's lighthouse; SIGKILL of a replica group's launcher (its workers stop with it);
SIGKILL of a worker once the last step is taken (during the final save or teardown)."""


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule."""

    at: float
    """Seconds after the job's first step (``after_end``: after its last step)."""
    kind: str
    """One of ``KINDS``."""
    group: int | None = None
    """The replica group it strikes (live mode; None: a job of restarts, or the job's
    lighthouse)."""
    rank: int | None = None
    """The worker's rank (in its group, in live mode)."""
    seconds: float = 0.0
    """How long a ``stop`` lasts."""

    def __str__(self) -> str:
        place = "" if self.rank is None else (
            f" rank {self.rank}" if self.group is None else f" g{self.group} rank {self.rank}")
        if self.kind == "launcher":
            place = f" g{self.group}"
        how = {"kill": "SIGKILL", "stop": f"SIGSTOP {self.seconds:g} s",
               "lighthouse": "SIGKILL the lighthouse", "launcher": "SIGKILL the launcher of",
               "after_end": "SIGKILL after the last step,"}[self.kind]
        when = "after the last step" if self.kind == "after_end" else f"{self.at:.2f} s"
        return f"{when}: {how}{place}"


@dataclass(frozen=True)
class Schedule:
    """The faults of one run, earliest first, and the seed they were drawn from."""

    seed: int
    faults: tuple[Fault, ...] = field(default_factory=tuple)

    @classmethod
    def draw(cls, seed: int, *, groups: int | None, ranks: int, kills: int = 3,
             stops: int = 0, lighthouse: int = 0, launchers: int = 0,
             after_end: bool = False, gap: tuple[float, float] = (0.3, 3.0),
             stop_s: tuple[float, float] = (1.0, 3.0), first: float = 0.5) -> Schedule:
        """Faults at random moments: ``kills`` SIGKILLs, ``stops`` SIGSTOPs (each of
        ``stop_s`` seconds, drawn), ``lighthouse`` lighthouse kills and ``launchers`` group
        launcher kills, in a random order, the first ``first`` seconds into training and
        each next one ``gap`` seconds later (drawn); ``after_end``: one more kill after the
        last step. Each worker's place is drawn among ``groups`` replica groups (None: a
        job of restarts) of ``ranks`` ranks."""
        rng = random.Random(seed)
        kinds = (["kill"] * kills + ["stop"] * stops + ["lighthouse"] * lighthouse
                 + ["launcher"] * launchers)
        rng.shuffle(kinds)
        faults = []
        at = first
        for kind in kinds:
            group: int | None = rng.randrange(groups) if groups else None
            rank: int | None = rng.randrange(ranks)
            seconds = round(rng.uniform(*stop_s), 2) if kind == "stop" else 0.0
            if kind == "lighthouse":
                group = rank = None
            elif kind == "launcher":
                rank = None
            faults.append(Fault(round(at, 2), kind, group, rank, seconds))
            at += rng.uniform(*gap)
        if after_end:
            faults.append(Fault(0.0, "after_end", rng.randrange(groups) if groups else None,
                                rng.randrange(ranks)))
        return cls(seed, tuple(faults))

    def __str__(self) -> str:
        return f"chaos seed {self.seed}: " + ("; ".join(map(str, self.faults)) or "no faults")
