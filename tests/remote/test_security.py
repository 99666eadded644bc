"""Security of the remote tier: the bearer token is checked (missing or wrong: one clear
error), never read from the config; TLS is required off loopback unless insecure, and works."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from shoal.config.loader import validate_run_tree
from shoal.errors import UsageError
from shoal.remote import GrpcRemoteTier, RemoteModule, RemoteTierError
from tests.helpers import run_shoal_in_process
from tests.remote.blocks import Block
from tests.remote.runs import write_config


def _token_file(tmp_path: Path, token: str) -> Path:
    path = tmp_path / f"token-{token}"
    path.write_text(token + "\n")
    return path


def test_missing_or_wrong_token_is_one_clear_error(serve, tmp_path, monkeypatch):
    server = serve("--token-file", str(_token_file(tmp_path, "s3cret")))
    config = write_config(tmp_path / "run", server.endpoint)
    out = run_shoal_in_process("train", "--config", str(config))  # refused before training
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"shoal train: error: remote tier {server.endpoint}: connect refused: no bearer token "
        "sent (check remote_hardware.token_file / token_env against the server's "
        "--token-file)")
    monkeypatch.setenv("SHOAL_TEST_TOKEN", "guess")
    wrong = GrpcRemoteTier({"endpoint": server.endpoint, "token_env": "SHOAL_TEST_TOKEN"})
    with pytest.raises(RemoteTierError, match="connect refused: wrong or missing bearer token"):
        wrong.capabilities()
    right = GrpcRemoteTier({"endpoint": server.endpoint,
                            "token_file": str(_token_file(tmp_path, "s3cret"))})
    block = Block()
    with torch.no_grad():
        assert torch.equal(RemoteModule(block, tier=right)(torch.ones(2, 32)),
                           block(torch.ones(2, 32)))


def test_the_token_never_comes_from_the_config(tmp_path):
    tree = {"model": {"builder": "tests.remote.blocks:model"},
            "data": {"builder": "shoal.examples.digits:build_data"},
            "optimizer": {"builder": "torch.optim:SGD", "args": {"lr": 0.1}},
            "remote_hardware": {"endpoint": "127.0.0.1:50051", "token": "s3cret"}}
    with pytest.raises(UsageError, match="remote_hardware.token: unknown key"):
        validate_run_tree(tree, "t")
    tree["remote_hardware"] = {"endpoint": "127.0.0.1:50051", "token_env": "SHOAL_UNSET_VAR"}
    with pytest.raises(UsageError, match="the environment variable SHOAL_UNSET_VAR is not set"):
        validate_run_tree(tree, "t")


def test_off_loopback_needs_tls_or_an_explicit_insecure(tmp_path):
    tree = {"model": {"builder": "tests.remote.blocks:model"},
            "data": {"builder": "shoal.examples.digits:build_data"},
            "optimizer": {"builder": "torch.optim:SGD", "args": {"lr": 0.1}},
            "remote_hardware": {"endpoint": "198.18.0.2:50051"}}
    with pytest.raises(UsageError, match="endpoint 198.18.0.2:50051 is not loopback: set "
                       "tls_ca"):
        validate_run_tree(dict(tree), "t")
    tree["remote_hardware"] = {"endpoint": "198.18.0.2:50051", "insecure": True}
    assert validate_run_tree(tree, "t").remote_hardware.insecure
    # The server side: no plain text off loopback without --insecure, no open door without
    # a token. Refused before anything listens (so in this process).
    out = run_shoal_in_process("remote", "serve", "--module", "tests.remote.blocks:block",
                               "--host", "198.18.0.2")
    assert out.returncode == 2
    assert "--host 198.18.0.2 is not loopback: give --tls-cert and --tls-key" in out.stderr
    out = run_shoal_in_process("remote", "serve", "--module", "tests.remote.blocks:block",
                               "--host", "198.18.0.2", "--insecure")
    assert out.returncode == 2 and "so give --token-file" in out.stderr


def make_certificate(directory: Path, ip: str) -> tuple[Path, Path]:
    """A self-signed certificate for the address ``ip`` and its key (openssl)."""
    cert, key = directory / f"cert-{ip}.pem", directory / f"key-{ip}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=shoal-remote-test", "-addext", f"subjectAltName=IP:{ip}",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def test_tls_verifies_the_server_and_carries_the_calls(serve, tmp_path):
    cert, key = make_certificate(tmp_path, "127.0.0.1")
    server = serve("--tls-cert", str(cert), "--tls-key", str(key))
    tier = GrpcRemoteTier({"endpoint": server.endpoint, "tls_ca": str(cert)})
    block = Block()
    x = torch.randn(3, 32, requires_grad=True)
    RemoteModule(block, tier=tier)(x).sum().backward()
    local_x = x.detach().clone().requires_grad_()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    block(local_x).sum().backward()
    assert torch.equal(x.grad, local_x.grad)
    assert all(torch.equal(grads[n], p.grad) for n, p in block.named_parameters())
    # A client that does not know the certificate, or speaks plain text, gets nowhere.
    other, _ = make_certificate(tmp_path, "127.0.0.2")
    for settings in ({"tls_ca": str(other)}, {}):
        stranger = GrpcRemoteTier({"endpoint": server.endpoint, "deadline_s": 5, **settings})
        with pytest.raises(RemoteTierError, match=f"remote tier {server.endpoint}: connect"):
            stranger.capabilities()


def test_a_token_too_large_for_the_metadata_is_named_with_its_size(tmp_path, monkeypatch):
    big = tmp_path / "big-token"
    big.write_text("x" * (1 << 20) + "\n")
    with pytest.raises(UsageError, match=rf"^remote_hardware.token_file {big}: the token is "
                       r"1,048,576 bytes; it travels in every call's metadata, which takes at "
                       r"most 4,096$"):
        GrpcRemoteTier({"endpoint": "127.0.0.1:50051", "token_file": str(big)})
    monkeypatch.setenv("SHOAL_TEST_TOKEN", "y" * 5000)
    with pytest.raises(UsageError, match=r"^remote_hardware.token_env SHOAL_TEST_TOKEN: the "
                       r"token is 5,000 bytes"):
        GrpcRemoteTier({"endpoint": "127.0.0.1:50051", "token_env": "SHOAL_TEST_TOKEN"})
    monkeypatch.setenv("SHOAL_TEST_TOKEN", "tab\there")
    with pytest.raises(UsageError, match="holds characters other than printable ASCII"):
        GrpcRemoteTier({"endpoint": "127.0.0.1:50051", "token_env": "SHOAL_TEST_TOKEN"})
    out = run_shoal_in_process("remote", "serve", "--module", "tests.remote.blocks:block",
                               "--port", "0", "--token-file", str(big))  # refused at once
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"shoal remote serve: error: --token-file {big}: the token is 1,048,576 bytes; it "
        "travels in every call's metadata, which takes at most 4,096")
