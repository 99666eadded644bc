"""Failures of the remote tier, injected: the server killed mid-step (one error naming the
endpoint and the step, within the deadline; with restarts the job resumes exactly once the
server is back), a server too slow for the deadline, a module that does not match, a call
repeated after a lost reply, a server replaced by one serving another module, waiting for a
server that is gone."""

from __future__ import annotations

import re
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from shoal.errors import UsageError
from shoal.launch.ports import free_port
from shoal.remote import GrpcRemoteTier, RemoteModule, RemoteTierError, wire
from tests import zygote
from tests.helpers import popen_shoal, run_shoal, states_equal
from tests.remote.blocks import Block
from tests.remote.conftest import wait_for
from tests.remote.runs import final_state, write_config

SLOW = ("--args", "{delay_s: 0.05}")  # each forward takes 50 ms: a step is in flight


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count('"type": "step"') if path.exists() else 0


def _train(config: Path, *flags: str) -> subprocess.Popen | zygote.Forked:
    return popen_shoal("train", "--config", str(config), "--nproc-per-node", "2", *flags,
                       text=True)


def test_server_killed_mid_step_is_one_error_naming_endpoint_and_step(serve, tmp_path):
    server = serve(*SLOW)
    config = write_config(tmp_path, server.endpoint, {"deadline_s": 10}, max_steps=400,
                          metrics={"every": 1})
    job = _train(config)
    wait_for(lambda: _steps(tmp_path) >= 5, 60, "step 5")
    server.kill()
    # The job would run its 400 slow steps for minutes: 60 s is a hang guard, and the summary
    # below says the job ended on the lost server.
    _, err = job.communicate(timeout=60)
    assert job.returncode == 1
    summary = next(line for line in err.splitlines() if "failed first" in line)
    assert f"raised RemoteTierError: remote tier {server.endpoint}: " in summary, summary
    assert " of step " in summary and "the server is unreachable after 4 tries" in summary
    assert " s; remote_hardware.on_failure: wait waits for it (" in summary, summary


def _read_lines(stream, lines: list[str]) -> threading.Thread:
    """Collect ``stream``'s lines in ``lines`` as they come (also keeps its pipe drained)."""
    def read() -> None:
        for line in stream:
            lines.append(line)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


def test_killed_server_back_and_the_job_resumes_exactly(serve, tmp_path):
    straight = write_config(tmp_path / "straight", None, max_steps=24)
    with ThreadPoolExecutor(1) as pool:  # the reference run, side by side with the other
        straight_run = pool.submit(run_shoal, "train", "--config", str(straight),
                                   "--nproc-per-node", "2")
        server = serve(*SLOW)
        config = write_config(tmp_path / "killed", server.endpoint,
                              {"on_failure": "wait", "wait_s": 60}, max_steps=24,
                              checkpoint_every=4, resume="auto", metrics={"every": 1})
        job = _train(config, "--max-restarts", "2")
        out_lines: list[str] = []
        err_lines: list[str] = []
        readers = [_read_lines(job.stdout, out_lines), _read_lines(job.stderr, err_lines)]
        # 120 s: a hang guard; alone, the job starts and reaches step 10 in about 10 s.
        wait_for(lambda: _steps(tmp_path / "killed") >= 10, 120, "step 10")
        server.kill()
        # The workers fail, and wait for the server (60 s: a hang guard, many times the
        # second or so their retries take).
        wait_for(lambda: any("shoal remote: waiting for the remote server" in line
                             for line in err_lines), 60, "the workers to wait")
        server.start()  # same port
        job.wait(timeout=150)
        for reader in readers:
            reader.join(timeout=10)
        err = "".join(err_lines)
        out = straight_run.result()
    assert out.returncode == 0, out.stderr[-3000:]
    assert job.returncode == 0, err[-3000:]
    assert "is back: the job can resume from its last checkpoint" in err
    assert f"shoal remote: waiting for the remote server at {server.endpoint} (" in err
    assert "resumed from" in err
    (a, meta_a), (b, meta_b) = final_state(tmp_path / "straight"), final_state(tmp_path / "killed")
    assert meta_a["global_step"] == meta_b["global_step"] == 24
    assert states_equal(a, b)


def _tier(endpoint: str, **settings) -> GrpcRemoteTier:
    return GrpcRemoteTier({"endpoint": endpoint, **settings})


def test_a_call_past_its_deadline_fails_naming_it(serve):
    server = serve("--args", "{delay_s: 3.0}")
    remote = RemoteModule(Block(), tier=_tier(server.endpoint, deadline_s=0.5))
    # The server answers after 3 s: the call fails only if its 0.5 s deadline ends it first.
    with pytest.raises(RemoteTierError, match=rf"remote tier {server.endpoint}: forward of "
                       r"step \d+: no reply within deadline_s 0.5 s \(raise it for a slow "
                       r"module; remote_hardware.on_failure: wait waits for a server that "
                       r"restarts\)$"):
        remote(torch.randn(4, 32))


def test_a_module_that_does_not_match_the_servers_is_refused(serve):
    server = serve()
    with pytest.raises(UsageError, match=r"serves tests.remote.blocks:block, whose parameters "
                       r"differ from the local Block's: fc1.bias, fc1.weight"):
        RemoteModule(Block(width=16), tier=_tier(server.endpoint))


def test_a_repeated_request_id_is_answered_from_the_cache_not_run_twice(serve):
    server = serve()
    tier = _tier(server.endpoint)
    remote = RemoteModule(Block(), tier=tier)
    x = torch.randn(4, 32, requires_grad=True)
    out = remote(x)
    forward_id = out.grad_fn.forward_id  # the custom Function's ctx

    def backward(request_id: str):
        header = {"op": "backward", "session": tier.session, "request_id": request_id,
                  "forward_id": forward_id}
        replies = tier._call(wire.encode(header, {"gout.0": torch.ones(4, 32)}), timeout=10)
        return wire.decode(replies)[1]

    first = backward("retry-me")
    again = backward("retry-me")  # the reply was lost, say: the same id asks again
    assert first.keys() == again.keys() and "gparam.fc1.weight" in first
    assert all(torch.equal(first[k], again[k]) for k in first)
    # A new id for the same forward would run backward twice: refused, by name.
    with pytest.raises(Exception, match="its forward is not held here"):
        backward("another-id")
    tier.close()


def test_calls_in_flight_from_two_sessions_do_not_mix(serve):
    server = serve()
    tiers = [_tier(server.endpoint), _tier(server.endpoint)]
    torch.manual_seed(0)
    blocks = [Block(), Block()]  # different weights
    remotes = [RemoteModule(b, tier=t) for b, t in zip(blocks, tiers, strict=True)]
    x = torch.randn(8, 32)
    results: dict[int, torch.Tensor] = {}

    def run(i: int) -> None:
        with torch.no_grad():
            for _ in range(20):
                results[i] = remotes[i](x)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    with torch.no_grad():
        for i in range(2):
            assert torch.equal(results[i], blocks[i](x))
    for t in tiers:
        t.close()


def test_on_failure_wait_says_what_it_waits_for_and_fail_names_the_option(capfd):
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    waiting = _tier(endpoint, on_failure="wait", wait_s=2.5, deadline_s=2)
    with pytest.raises(RemoteTierError, match=f"remote tier {endpoint}: connect"):
        waiting.capabilities()
    lines = [line for line in capfd.readouterr().err.splitlines() if "waiting" in line]
    # About a dozen health checks failed: one line said so (the next is due after 10 s).
    assert len(lines) == 1, lines
    assert re.fullmatch(rf"shoal remote: waiting for the remote server at {endpoint} "
                        r"\(\d s of on_failure 'wait' up to wait_s 2.5 s\)", lines[0]), lines
    failing = _tier(endpoint)
    with pytest.raises(RemoteTierError, match=r"unreachable after 1 try in 0.0 s; "
                       r"remote_hardware.on_failure: wait waits for it \(.*\)$"):
        failing.capabilities()


def _replace(server, module: str) -> None:
    """Kill ``server`` and start one serving ``module`` on its port."""
    server.kill()
    for stream in (server.proc.stdout, server.proc.stderr):
        stream.close()
    server.module = module
    server.start()


def test_a_server_replaced_by_one_serving_another_module_is_refused_naming_both(serve):
    server = serve()
    block = Block()
    remote = RemoteModule(block, tier=_tier(server.endpoint, deadline_s=10))
    x = torch.randn(4, 32)
    with torch.no_grad():
        remote(x)
    _replace(server, "tests.remote.blocks:swapped")  # the same parameters, another forward
    message = (rf"^remote tier {server.endpoint}: forward of step \d+: the server now serves "
               r"tests.remote.blocks:swapped, not tests.remote.blocks:block which this run "
               r"started with \(it was replaced: serve the same module there again, or "
               r"start the run anew\)$")
    # Unchanged parameters: the new server asks for them, and is asked what it serves.
    with torch.no_grad(), pytest.raises(RemoteTierError, match=message):
        remote(x)
    # After an optimizer step the parameters go with the call, which names its module.
    with torch.no_grad():
        block.fc1.bias.add_(0.1)
    with torch.no_grad(), pytest.raises(RemoteTierError, match=message):
        remote(x)
    # The same module served again is used as before.
    _replace(server, "tests.remote.blocks:block")
    with torch.no_grad():
        assert torch.equal(remote(x), block(x))
