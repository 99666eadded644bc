"""Live mode on one machine: the job as replica groups, each its own elastic agent with its
own workers and restarts, meeting at a lighthouse this launcher starts and stops.

Each group is a plain `shoal run` of one group (started here as a child process), told its
place by ``ReplicaPlace.environ()``. A group whose restarts are used up is lost for good:
under 'exact' the others cannot go on without it and are stopped; under 'available' they
go on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from shoal.ft import FaultToleranceConfig, ReplicaPlace
from shoal.ft.lighthouse import start_lighthouse
from shoal.launch.config import LaunchSpec
from shoal.launch.ports import free_port

_HOST = "127.0.0.1"


def _group_command(spec: LaunchSpec, group: int) -> list[str]:
    argv = [sys.executable, "-m", "shoal", "run", "--nproc-per-node", str(spec.nproc_per_node),
            "--max-restarts", str(spec.max_restarts),
            "--hang-timeout", str(spec.hang_timeout or 0)]
    if spec.log_dir:
        argv += ["--log-dir", os.path.join(spec.log_dir, f"group{group}")]
    if spec.debug:
        argv.append("--debug")
    if spec.module:
        argv.append("-m")
    return [*argv, spec.entry, *spec.args]


def _say(message: str) -> None:
    print(f"shoal: {message}", file=sys.stderr, flush=True)


def launch_groups(spec: LaunchSpec) -> int:
    """Run ``spec`` as ``spec.replica_groups`` groups; the launcher's exit code."""
    from shoal.ft.engine import check_available

    check_available()
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
         f"{config.policy}, lighthouse {address}")
    children: list[subprocess.Popen] = []
    stopping: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for group in range(groups):
            place = ReplicaPlace(group, groups, address, config, host=_HOST)
            children.append(subprocess.Popen(_group_command(spec, group),
                                             env={**os.environ, **place.environ()}))
        return _wait(children, config, stopping)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for child in children:
            if child.poll() is None:
                child.terminate()
                child.wait()
        if lighthouse is not None:
            lighthouse.stop()


def _wait(children: list[subprocess.Popen], config: FaultToleranceConfig,
          stopping: list[int]) -> int:
    lost: dict[int, int] = {}
    finished_at: float | None = None
    while True:
        codes = [child.poll() for child in children]
        if finished_at is None and 0 in codes:
            finished_at = time.monotonic()
        if (config.policy == "available" and finished_at is not None
                and time.monotonic() - finished_at > 2 * config.step_timeout_s):
            # The job's steps are done; a replacement that had not rejoined has none left.
            for group, child in enumerate(children):
                if child.poll() is None:
                    _say(f"replica group {group} had not rejoined when the others finished: "
                         "stopped")
                    child.terminate()
                    child.wait()
            codes = [0 if code is None else code for code in codes]
        for group, code in enumerate(codes):
            if code not in (None, 0) and group not in lost:
                lost[group] = code
                if stopping:
                    continue
                if config.policy == "exact":
                    _say(f"replica group {group} failed for good (exit code {code}): policy "
                         "exact needs every group, so the others stop")
                    for child in children:
                        if child.poll() is None:
                            child.terminate()
                else:
                    _say(f"replica group {group} failed for good (exit code {code}); the "
                         "others go on without it (policy available)")
        if all(code is not None for code in codes):
            if stopping:
                return 128 + stopping[0]
            failed = [code for code in codes if code]
            if config.policy == "available" and len(failed) < len(codes):
                return 0
            return failed[0] if failed else 0
        time.sleep(0.1)
