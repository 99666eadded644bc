"""Live mode across machines: every node's launcher runs its own replica groups (one per
node by default), and the groups meet at a lighthouse that node 0's launcher starts.

    shoal run --nnodes 2 --node-rank K --master-addr HOST0 --master-port P --ft-mode live ...

Group indices are ``node_rank x R + i`` of ``nnodes x R`` (R: ``--replica-groups``, else
1). A group's workers meet in a store of their own node; nothing crosses machines but the
quorum (at the lighthouse, which listens on ``--master-addr:--master-port``) and torchft's
process group across groups. A node that is lost is a group that is lost: the others go on
('available') or wait for `shoal run` to be started again on that node ('exact').
"""

from __future__ import annotations

import os
import socket
import sys
import time

from shoal.errors import UsageError
from shoal.ft.config import ENV_HOST
from shoal.ft.lighthouse import start_lighthouse
from shoal.launch.config import LaunchSpec
from shoal.launch.groups import GroupSet, run_groups
from shoal.launch.network import choose_interface, resolve
from shoal.launch.ports import check_port_free

LIGHTHOUSE_WAIT_S = 600.0
"""How long a node waits for node 0's lighthouse (torch's own rendezvous waits as long for
the nodes of a job)."""


def _say(message: str) -> None:
    print(f"shoal: {message}", file=sys.stderr, flush=True)


def _url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def advertised_host(spec: LaunchSpec) -> str:
    """The address the other nodes reach this node's groups at: ``SHOAL_FT_HOST`` if the
    user set it, else this node's address on the route to the master. Points gloo at that
    route's interface too (unless the user did)."""
    _, local = choose_interface(spec.master_addr, f"node {spec.node_rank}")
    return os.environ.get(ENV_HOST) or local


def wait_for_lighthouse(address: str, port: int, timeout: float = LIGHTHOUSE_WAIT_S) -> None:
    """Return once something listens at ``address:port`` (node 0 may start later)."""
    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            with socket.create_connection((address, port), timeout=2.0):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise UsageError(
                    f"no lighthouse at {_url(address, port)} within {timeout:g} s "
                    f"({exc.strerror or exc}): start `shoal run` on node 0 with the same "
                    "--master-addr and --master-port") from None
            if not said:
                _say(f"waiting for node 0's lighthouse at {_url(address, port)}")
                said = True
            time.sleep(0.5)


def launch_live_nodes(spec: LaunchSpec) -> int:
    """Run this node's share of a live job's replica groups; the launcher's exit code."""
    from shoal.ft.engine import check_available

    check_available()
    local = spec.replica_groups
    total = spec.nnodes * local
    assert spec.fault_tolerance is not None  # live mode (spec.live) has its settings
    config = spec.fault_tolerance.model_copy(update={"replica_groups": total})
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at INFO
    groups = GroupSet(spec.node_rank * local, local, total, advertised_host(spec))
    lighthouse = None
    address = config.lighthouse
    if address is None:
        _, master = resolve(spec.master_addr)
        port = spec.master_port
        assert port is not None  # LaunchSpec requires it with --nnodes above 1
        if spec.node_rank == 0:
            check_port_free(master, port, advice="give node 0's own address as "
                            "--master-addr (its launcher starts the live job's lighthouse "
                            "there)")
            exact = config.policy == "exact"
            lighthouse = start_lighthouse(master, port, total if exact else 1, config)
            address = lighthouse.address
        else:
            address = _url(master, port)
            wait_for_lighthouse(master, port)
    names = ", ".join(str(g) for g in groups.indices)
    _say(f"live mode: node {spec.node_rank} runs replica group{'s' if local > 1 else ''} "
         f"{names} of {total} ({spec.nproc_per_node} process"
         f"{'es' if spec.nproc_per_node > 1 else ''} each) at {groups.host}, "
         f"policy {config.policy}, lighthouse {address}"
         + (f" (pid {lighthouse.process.pid})" if lighthouse else ""))
    return run_groups(spec, config, address, lighthouse, groups)

