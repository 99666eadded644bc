"""Live mode on one machine: the job as replica groups, each its own elastic agent with its
own workers and restarts, meeting at a lighthouse this launcher starts and stops.

Each group is a plain `shoal run` of one group (a child forked from this launcher,
shoal.launch.forked_command), told its place by ``ReplicaPlace.environ()``. A group whose
restarts are used up is lost for good: under 'exact' the others cannot go on without it and
are stopped; under 'available' they go on. Across machines (launch/live_nodes.py) each
node's launcher runs its own share of the groups the same way (``GroupSet``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from shoal.ft import FaultToleranceConfig, ReplicaPlace
from shoal.ft.lighthouse import Lighthouse, answers, start_lighthouse
from shoal.launch.config import LaunchSpec
from shoal.launch.forked_command import ForkedCommand
from shoal.launch.ports import free_port
from shoal.launch.worker_start import FORK_FIRST_ENV

_HOST = "127.0.0.1"


@dataclass(frozen=True)
class GroupSet:
    """The replica groups one launcher runs, out of the job's."""

    first: int
    """Index of this launcher's first group (node rank x groups per node)."""
    local: int
    """Groups this launcher runs (``--replica-groups``, else 1)."""
    total: int
    """Groups in the job, on every node."""
    host: str = _HOST
    """The address the other groups reach these groups' managers, stores and heal servers
    at (this node's address toward the master, across machines)."""

    @property
    def indices(self) -> range:
        return range(self.first, self.first + self.local)

    @property
    def across_nodes(self) -> bool:
        return self.local < self.total


def _group_command(spec: LaunchSpec, group: int, host: str, entry: str | None = None
                   ) -> list[str]:
    """The group's `shoal run`, after ``shoal`` (``entry``: in place of ``spec.entry``)."""
    # --master-addr: the group's store is where the other groups' process group meets it.
    argv = ["run", "--nproc-per-node", str(spec.nproc_per_node),
            "--master-addr", host,
            "--max-restarts", str(spec.max_restarts),
            "--hang-timeout", str(spec.hang_timeout or 0)]
    if spec.log_dir:
        argv += ["--log-dir", os.path.join(spec.log_dir, f"group{group}")]
    if spec.debug:
        argv.append("--debug")
    if not spec.preload:
        argv.append("--no-preload")
    argv += ["--scheduling", spec.scheduling]
    if spec.module:
        argv.append("-m")
    return [*argv, entry or spec.entry, *spec.args]


def _say(message: str) -> None:
    print(f"shoal: {message}", file=sys.stderr, flush=True)


def launch_groups(spec: LaunchSpec) -> int:
    """Run ``spec`` as ``spec.replica_groups`` groups; the launcher's exit code."""
    from shoal.ft.engine import check_available

    check_available()
    assert spec.fault_tolerance is not None  # live mode (spec.live) has its settings
    config = spec.fault_tolerance.model_copy(update={"replica_groups": spec.replica_groups})
    groups = spec.replica_groups
    # torchft's Rust side logs every quorum at INFO: only its warnings, unless asked.
    os.environ.setdefault("RUST_LOG", "warn")
    lighthouse = None
    address = config.lighthouse
    if address is None:
        exact = config.policy == "exact"
        lighthouse = start_lighthouse(_HOST, free_port(_HOST), groups if exact else 1, config)
        address = lighthouse.address
    _say(f"live mode: {groups} replica groups x {spec.nproc_per_node} processes, policy "
         f"{config.policy}, lighthouse {address}"
         + (f" (pid {lighthouse.process.pid})" if lighthouse else "")
         + ("; a missing group's samples are skipped: the result is not bitwise a run's "
            "without failures" if config.policy == "available" else ""))
    return run_groups(spec, config, address, lighthouse, GroupSet(0, groups, groups))


def copy_folder(group: int) -> str:
    """The working folder of copy ``group`` of ``--independent-copies``."""
    return os.path.abspath(f"replica-group-{group}")


def launch_copies(spec: LaunchSpec) -> int:
    """``--independent-copies``: ``spec.replica_groups`` copies of the job that never meet,
    each its own `shoal run` (with its own restarts) in a folder of its own, so that no two
    write the same files. The job ends when every copy has; its exit code is the first
    failed copy's."""
    groups = range(spec.replica_groups)
    here = os.getcwd()
    # The script's own folder stays where it is; a module is found from here, as before.
    entry = spec.entry if spec.module else os.path.abspath(spec.entry)
    path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    for group in groups:
        os.makedirs(copy_folder(group), exist_ok=True)
    each = f"{spec.nproc_per_node} process{'es' if spec.nproc_per_node > 1 else ''}"
    _say(f"{len(groups)} independent copies x {each}, which never meet (no live "
         f"recovery), in {copy_folder(0)} to {copy_folder(groups[-1])}")
    children = [ForkedCommand(_group_command(spec, group, _HOST, entry), env={
        **os.environ, "PYTHONPATH": path, "SHOAL_COPY": str(group),
        **spec.agent.for_group(group).environ()}, cwd=copy_folder(group)) for group in groups]
    stopping: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        for child in children:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    failed: list[int] = []
    try:
        running = set(groups)
        while running:
            for group in sorted(running):
                code = children[group].poll()
                if code is not None:
                    running.discard(group)
                    if code:
                        failed.append(code)
                        _say(f"copy {group} failed (exit code {code}); the others go on")
            time.sleep(0.1)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for child in children:
            child.terminate()
            child.wait()
    if stopping:
        return 128 + stopping[0]
    return failed[0] if failed else 0


def run_groups(spec: LaunchSpec, config: FaultToleranceConfig, address: str,
               lighthouse: Lighthouse | None, groups: GroupSet) -> int:
    """Run this launcher's ``groups`` until they are done; stop ``lighthouse`` (if this
    launcher started it) at the end. The launcher's exit code."""
    job = _GroupJob(spec, config, address, lighthouse, groups)
    previous = {s: signal.signal(s, job.forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        job.start()
        return job.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        job.stop_all()
        if lighthouse is not None:
            lighthouse.stop()


class _GroupJob:
    """The groups' processes, watched until they are done."""

    def __init__(self, spec: LaunchSpec, config: FaultToleranceConfig, address: str,
                 lighthouse: Lighthouse | None, groups: GroupSet):
        self.spec, self.config, self.address, self.lighthouse = spec, config, address, lighthouse
        self.groups = groups
        self.children: list[ForkedCommand] = []
        self.stopping: list[int] = []
        # Policy exact: a group lost for good makes every group start again from the last
        # checkpoint, once (today's restart, for the whole job). Across machines this
        # launcher cannot restart the other nodes' groups.
        self.fallbacks = 1 if config.policy == "exact" and not groups.across_nodes else 0

    def start(self) -> None:
        g = self.groups
        self.children = [
            ForkedCommand(_group_command(self.spec, group, g.host), env={
                **os.environ, FORK_FIRST_ENV: "1", **self.spec.agent.for_group(group).environ(),
                **ReplicaPlace(group, g.total, self.address, self.config, g.host).environ()})
            for group in g.indices]

    def forward(self, signum: int, _frame: object) -> None:
        self.stopping.append(signum)
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signum)

    def stop_all(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.terminate()
        for child in self.children:
            child.wait()

    def _watch_lighthouse(self) -> None:
        lighthouse = self.lighthouse
        if lighthouse is not None and lighthouse.process.poll() is not None \
                and not self.stopping:
            # It holds nothing a new one cannot rebuild from the groups' next requests.
            _say(f"the lighthouse (pid {lighthouse.process.pid}) ended with code "
                 f"{lighthouse.process.returncode}: started again at {lighthouse.address}")
            lighthouse.restart()

    def _lost(self, group: int, code: int) -> str:
        """A group's agent gave up (its restarts used up): 'on' (the job goes on), 'again'
        (every group was started again) or 'stop'."""
        if self.lighthouse is None and not answers(self.address):
            # The user's lighthouse is gone: no step commits, and no restart brings it back.
            # The other groups stop at their own quorum deadline.
            _say(f"replica group {group} stopped (exit code {code}): the lighthouse "
                 f"{self.address} does not answer, and no step commits without it")
            return "on"
        if self.config.policy == "available":
            _say(f"replica group {group} failed for good (exit code {code}); the others go "
                 "on without it (policy available)")
            return "on"
        if self.fallbacks:
            self.fallbacks -= 1
            _say(f"replica group {group} did not come back (exit code {code}, its restarts "
                 "used up): falling back to a restart of every group from the last "
                 "checkpoint (policy exact)")
            self.stop_all()
            self.start()
            return "again"
        if self.groups.across_nodes:
            _say(f"replica group {group} failed for good (exit code {code}): policy exact "
                 "needs every group, so this node's launcher stops; the other nodes' groups "
                 f"wait {self.config.replacement_timeout_s:g} s (replacement_timeout_s) for "
                 "`shoal run` to be started again here")
        else:
            _say(f"replica group {group} failed for good (exit code {code}): policy exact "
                 "needs every group, so the others stop")
        self.stop_all()
        return "stop"

    def wait(self) -> int:
        lost: set[int] = set()
        finished_at: float | None = None
        while True:
            self._watch_lighthouse()
            codes = [child.poll() for child in self.children]
            if finished_at is None and 0 in codes:
                finished_at = time.monotonic()
            if (self.config.policy == "available" and finished_at is not None
                    and time.monotonic() - finished_at > 2 * self.config.step_timeout_s):
                # The job's steps are done; a replacement not yet back has none left.
                for group, child in zip(self.groups.indices, self.children, strict=True):
                    if child.poll() is None:
                        _say(f"replica group {group} had not rejoined when the others "
                             "finished: stopped")
                        child.terminate()
                        child.wait()
                codes = [0 if code is None else code for code in codes]
            for group, code in zip(self.groups.indices, codes, strict=False):
                if code not in (None, 0) and group not in lost and not self.stopping:
                    lost.add(group)
                    verdict = self._lost(group, code)
                    if verdict == "stop":
                        return code
                    if verdict == "again":
                        lost.clear()
                        codes = [None]
                        break
            if all(code is not None for code in codes):
                if self.stopping:
                    return 128 + self.stopping[0]
                failed = [code for code in codes if code]
                if self.config.policy == "available" and len(failed) < len(codes):
                    return 0
                return failed[0] if failed else 0
            time.sleep(0.1)
