"""The remote tier across two hosts: the block served on host 0 (TLS, token), the trainer's
two processes on host 1; the result is bit for bit the all-local run's."""

import subprocess

from tests.helpers import REPO, states_equal
from tests.multihost.test_multinode import _env, _local, _shoal
from tests.remote.runs import final_state, write_config
from tests.remote.test_security import make_certificate

PORT = 29620


def test_block_on_another_host_trains_bitwise_like_local(make_hosts, tmp_path):
    hosts = make_hosts(2)
    server_ip = hosts.addr(0)
    cert, key = make_certificate(tmp_path, server_ip)
    token = tmp_path / "token"
    token.write_text("host-token\n")
    server = hosts.popen(0, _shoal("remote", "serve", "--module", "tests.remote.blocks:block",
                                   "--host", server_ip, "--port", str(PORT), "--threads", "1",
                                   "--tls-cert", str(cert), "--tls-key", str(key),
                                   "--token-file", str(token)),
                         cwd=REPO, env=_env(), stdout=subprocess.PIPE, text=True)
    assert f"at {server_ip}:{PORT} (TLS, token required)" in server.stdout.readline()
    remote = write_config(tmp_path / "remote", f"{server_ip}:{PORT}",
                          {"tls_ca": str(cert), "token_file": str(token)})
    local = write_config(tmp_path / "local", None)
    alone = _local("train", "--config", str(local), "--nproc-per-node", "2")  # side by side
    out = hosts.run(1, _shoal("train", "--config", str(remote), "--nproc-per-node", "2"),
                    cwd=REPO, env=_env(), capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    output = alone.communicate(timeout=150)[0]
    assert alone.returncode == 0, output[-3000:]
    (a, _), (b, meta) = final_state(tmp_path / "local"), final_state(tmp_path / "remote")
    assert meta["global_step"] == 12
    assert states_equal(a, b)
