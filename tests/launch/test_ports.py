"""Ports a launcher picks for a server that another process opens later."""

import socket
import subprocess
import sys

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import api

from shoal.launch import launcher, ports


def test_a_free_port_is_drawn_below_the_ports_the_os_hands_out():
    top = min(ports.ephemeral_ports().start, 30000)
    if top <= 16000:
        pytest.skip(f"this machine's ephemeral range starts at {top}: no room below it")
    picked = {ports.free_port() for _ in range(20)}
    assert all(15000 <= p < top and p not in range(29400, 29511) for p in picked), picked
    assert len(picked) > 1, "drawn at random, not the same port each time"
    for port in picked:  # free on every address, as a store listening on all of them needs
        with socket.socket() as sock:
            sock.bind(("", port))


def test_a_taken_port_is_never_drawn(monkeypatch):
    draw = ports.random.SystemRandom.randrange
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        draws = iter([taken, taken])
        monkeypatch.setattr(ports.random.SystemRandom, "randrange",
                            lambda self, a, b: next(draws, None) or draw(self, a, b))
        monkeypatch.setattr(ports, "ephemeral_ports", lambda: range(60000, 61000))
        assert ports.free_port() != taken


def test_a_port_another_process_drew_and_has_not_bound_is_never_drawn(monkeypatch):
    """Two launchers that draw at once: the second never gets the port the first drew, free
    as it still is until the first's worker binds it (before, both could: EADDRINUSE in
    one of the jobs). Once the first process has ended, the port can be drawn again."""
    if min(ports.ephemeral_ports().start, 30000) <= 16000:  # the first process's draw
        pytest.skip("this machine's ephemeral range leaves no room below it: the OS picks")
    monkeypatch.setattr(ports, "ephemeral_ports", lambda: range(32768, 61000))
    first = subprocess.Popen(
        [sys.executable, "-c", "import sys; from shoal.launch import ports; "
         "print(ports.free_port(), flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        drawn = int(first.stdout.readline())
        draw = ports.random.SystemRandom.randrange
        draws = iter([drawn, drawn])
        monkeypatch.setattr(ports.random.SystemRandom, "randrange",
                            lambda self, a, b: next(draws, None) or draw(self, a, b))
        assert ports.free_port() != drawn
    finally:
        first.communicate("", timeout=60)
    draws = iter([drawn])
    assert ports.free_port() == drawn


def test_without_room_below_the_range_the_os_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_ports", lambda: range(1024, 65536))
    port = ports.free_port()
    assert 1024 <= port < 65536


def test_a_restartable_jobs_worker_store_port_comes_from_free_port(monkeypatch):
    """torch's own rendezvous info, built as the agent builds it for each attempt."""
    monkeypatch.setattr(api, "get_free_port", api.get_free_port)  # restored afterwards
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    monkeypatch.setattr(launcher, "free_port", lambda: 17171)
    launcher.fresh_store_per_attempt(True)
    info = api.RendezvousStoreInfo.build(0, HashStore(), local_addr="127.0.0.1")
    assert info.master_port == 17171
