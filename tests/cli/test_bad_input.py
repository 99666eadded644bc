"""Bad input: one clear line on stderr, exit code 2, no traceback, no process started.

The first tests run the real command; the matrices of bad values go through the command's
own ``main`` in this process (``run_shoal_in_process``), a process start saved per case.
"""

from __future__ import annotations

import socket

import pytest

from tests.helpers import run_shoal, run_shoal_in_process

DIGITS = "examples/digits.yaml"


def _assert_one_line_error(out, *needles: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_script():
    _assert_one_line_error(run_shoal("run", "no/such/script.py"), "script not found")


def test_missing_module():
    _assert_one_line_error(run_shoal("run", "-m", "no_such_module_xyz"), "module not found")


def test_unknown_flag():
    _assert_one_line_error(run_shoal("run", "--nprocs", "2", "x.py"), "--nprocs")


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_bad_nproc(tmp_path, value):
    script = tmp_path / "s.py"
    script.write_text("")
    _assert_one_line_error(run_shoal_in_process("run", "--nproc-per-node", value, str(script)),
                           "--nproc-per-node")


def test_taken_port(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        out = run_shoal("run", "--nproc-per-node", "2", "--master-port", str(port), str(script))
    _assert_one_line_error(out, f"--master-port {port}", "already in use")


@pytest.mark.parametrize("override, needles", [
    ("trainer.epochz=3", ["trainer.epochz", "unknown key"]),
    ("trainer.batch_size=many", ["trainer.batch_size", "integer"]),
    ("trainer.precision=16", ["trainer.precision"]),
    ("model.builder=no_such_pkg.models:mlp", ["model.builder", "cannot import"]),
    ("model.builder=shoal.examples.digits:missing", ["model.builder", "no attribute"]),
    ("model.builder=not-an-import-path", ["model.builder", "package.module:function"]),
    ("optimizer.args.learning_rate=0.1", ["optimizer.args", "learning_rate"]),
    ("trainer.compression.ratio=0", ["trainer.compression.ratio", "greater than 0"]),
    ("trainer.compression.ratio=1.5", ["trainer.compression.ratio", "less than or equal to 1"]),
    ("trainer.compression.rank=0", ["trainer.compression.rank", "greater than or equal to 1"]),
    ("trainer.compression=gzip", ["trainer.compression.name", "'powersgd'"]),
    ("trainer.local_sgd.period=0", ["trainer.local_sgd.period", "greater than or equal to 1"]),
    ("trainer.diloco.period=0", ["trainer.diloco.period", "greater than or equal to 1"]),
    ("model.args.hidden=abc", ["model.args.hidden", "valid integer", "'abc'"]),
    ("trainer.resume=/nonexistent/checkpoint",
     ["trainer", "resume /nonexistent/checkpoint", "no such directory"]),
])
def test_invalid_config(override, needles):
    _assert_one_line_error(run_shoal_in_process("train", "--config", DIGITS, override), *needles)


def test_invalid_config_from_the_real_command():
    _assert_one_line_error(run_shoal("train", "--config", DIGITS, "model.args.hidden=abc"),
                           "model.args.hidden", "valid integer")


def test_topology_that_does_not_fit_the_job_fails_before_any_worker():
    out = run_shoal_in_process("train", "--config", DIGITS, "--nproc-per-node", "2",
                               "trainer.parallel.tp=3")
    _assert_one_line_error(out, "trainer.parallel", "tp 3", "2 processes")


def test_missing_and_malformed_config(tmp_path):
    _assert_one_line_error(run_shoal_in_process("train", "--config", str(tmp_path / "none.yaml")),
                           "config file not found")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    _assert_one_line_error(run_shoal_in_process("train", "--config", str(bad)), "not valid YAML")
    missing = tmp_path / "missing.yaml"
    missing.write_text("trainer: {epochs: 1}\n")
    _assert_one_line_error(run_shoal_in_process("train", "--config", str(missing)), "model",
                           "Field required")


def test_compression_needs_the_ddp_strategy():
    out = run_shoal_in_process("train", "--config", DIGITS, "trainer.strategy=diloco",
                               "trainer.compression=topk")
    _assert_one_line_error(out, "compression 'topk'", "strategy 'diloco'")


def test_scaling_of_a_reinforcement_learning_run_is_refused(tmp_path):
    out = run_shoal_in_process("bench", "scaling", "--config", "examples/cartpole.yaml",
                               "--out", str(tmp_path))
    _assert_one_line_error(out, "shoal bench scaling measures a Trainer's steps",
                           "examples/cartpole.yaml is a reinforcement learning run")
