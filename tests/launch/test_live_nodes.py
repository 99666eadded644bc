"""Live mode across nodes: how it is chosen, and the one-line refusals at its edge (the
run across hosts is tests/multihost/test_live_nodes.py)."""

from __future__ import annotations

import argparse
import os
import socket
from unittest import mock

import pytest

from shoal.cli.run import add_launch_arguments, spec_from_args
from shoal.errors import UsageError
from shoal.launch.live_nodes import launch_live_nodes, wait_for_lighthouse
from tests.helpers import REPO

SCRIPT = f"{REPO}/tests/ft/live_job.py"


def _spec(*flags: str):
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    args = parser.parse_args(list(flags))
    return spec_from_args(args, SCRIPT, [], module=False)


def test_ft_mode_live_on_two_nodes_is_one_group_per_node():
    spec = _spec("--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                 "--master-port", "29500", "--ft-mode", "live", "--ft-policy", "available")
    assert spec.fault_tolerance.live and spec.fault_tolerance.policy == "available"
    assert spec.replica_groups == 1
    assert _spec("--nnodes", "2", "--node-rank", "0", "--master-port", "29500",
                 "--ft-mode", "live", "--replica-groups", "3").replica_groups == 3
    assert not _spec("--nnodes", "2", "--master-port", "1", "--node-rank", "0"
                     ).live


@pytest.mark.parametrize("flags, message", [
    (("--ft-mode", "live"), "live mode needs at least 2 replica groups: run on 2 or more "
                            "nodes"),
    (("--ft-mode", "restart", "--replica-groups", "2"), "--replica-groups runs live mode"),
    (("--ft-policy", "available"), "add --ft-mode live"),
    (("--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29500", "--rdzv-id", "j",
      "--ft-mode", "live"), "live mode across nodes runs one replica group per node"),
])
def test_what_cannot_work_is_one_line(flags, message):
    with pytest.raises(UsageError, match=message):
        _spec(*flags)


def test_a_node_without_a_lighthouse_says_where_it_waited():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(UsageError, match=rf"no lighthouse at http://127.0.0.1:{port} "
                                             r"within 1 s .*start `shoal run` on node 0"):
            wait_for_lighthouse("127.0.0.1", port, timeout=1.0)


def test_node_0_says_when_it_cannot_listen_for_the_lighthouse():
    pytest.importorskip("torchft")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        spec = _spec("--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                     "--master-port", str(port), "--ft-mode", "live")
        # (The launcher sets the interface variables for its workers: kept out of the
        # environment of the tests that run after this one.)
        with mock.patch.dict(os.environ), pytest.raises(
                UsageError, match=rf"--master-port {port} on 127.0.0.1 is already in use "
                                  r".*its launcher starts the live job's lighthouse there"):
            launch_live_nodes(spec)


def test_an_address_not_of_this_node_is_not_called_in_use():
    from shoal.launch.ports import check_port_free

    # 192.0.2.1 (TEST-NET-1) is no address of this machine: bind fails, nothing is sent.
    with pytest.raises(UsageError, match="--master-port 29500 on 192.0.2.1 cannot be "
                                         "listened on"):
        check_port_free("192.0.2.1", 29500)
