"""`shoal run` takes torchrun's command line: torchrun's own parser and shoal's read the same
command lines to the same values, for every flag of the installed torch's torchrun in each
of its spellings, and the values reach torch's LaunchConfig as torchrun's do."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest
from torch.distributed.run import config_from_args, get_args_parser

from shoal.cli.main import build_parser
from shoal.cli.run import spec_from_args
from shoal.launch.launcher import build_launch_config
from tests.helpers import run_shoal, run_shoal_in_process

# A value for each of torchrun's flags that takes one (test hosts' addresses only).
SAMPLES = {
    "nnodes": "2", "nproc_per_node": "2", "rdzv_backend": "c10d",
    "rdzv_endpoint": "198.18.0.1:29400", "rdzv_id": "job7", "rdzv_conf": "join_timeout=30",
    "max_restarts": "3", "monitor_interval": "0.5", "start_method": "fork",
    "event_log_handler": "console", "role": "trainer", "log_dir": "/tmp/logs",
    "redirects": "3", "tee": "0:1,1:2", "local_ranks_filter": "0,1",
    "duplicate_stdout_filters": "loss,step", "duplicate_stderr_filters": "error",
    "node_rank": "1", "master_addr": "198.18.0.1", "master_port": "29500",
    "local_addr": "198.18.0.2", "logs_specs": "mine", "numa_binding": "node",
    "signals_to_handle": "SIGTERM,SIGUSR1", "shutdown_timeout": "45",
    "log_line_prefix_template": "${hostname}:${rank}: ",
}
# Refused by shoal in one line (tested below), and by torchrun's parser acted on at once.
REFUSED = {"print_completion"}


def _torchrun_flags() -> list[tuple[str, str, bool]]:
    """(spelling, dest, takes a value) of every flag torchrun has."""
    return [(spelling, action.dest, action.nargs != 0)
            for action in get_args_parser()._actions
            for spelling in action.option_strings if action.dest != "help"]


def _shoal_run_parser() -> argparse.ArgumentParser:
    return build_parser()[0].commands["run"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spelling, dest, takes_value", _torchrun_flags(),
                         ids=[flag[0] for flag in _torchrun_flags()])
def test_each_torchrun_flag_reads_as_torchrun_reads_it(spelling, dest, takes_value):
    if dest in REFUSED:
        out = run_shoal_in_process("run", spelling, "bash", "README.md")
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert "shoal prints no shell completion script" in out.stderr
        return
    assert not takes_value or dest in SAMPLES, f"no sample value for torchrun's {spelling}"
    argv = [spelling, SAMPLES[dest]] if takes_value else [spelling]
    theirs = get_args_parser().parse_args([*argv, "train.py", "--lr", "1"])
    ours = _shoal_run_parser().parse_args([*argv, "train.py", "--lr", "1"])
    assert getattr(ours, dest) == getattr(theirs, dest)
    assert (ours.entry, ours.args) == (theirs.training_script, theirs.training_script_args)
    if takes_value and not spelling.startswith("--"):
        return  # -r / -t: the "=" form is for long flags
    if takes_value:
        joined = _shoal_run_parser().parse_args([f"{spelling}={SAMPLES[dest]}", "train.py"])
        assert getattr(joined, dest) == getattr(theirs, dest)


def _configs(tmp_path, argv: list[str]):
    """torch's LaunchConfig as torchrun makes it and as shoal makes it, for ``argv``."""
    script = tmp_path / "train.py"
    script.write_text("")
    theirs, _, _ = config_from_args(get_args_parser().parse_args([*argv, str(script)]))
    args = _shoal_run_parser().parse_args([*argv, str(script)])
    spec = spec_from_args(args, args.entry, args.args, args.module)
    return theirs, build_launch_config(spec, str(tmp_path))


@pytest.mark.timeout(60)
def test_the_values_reach_the_launch_config_as_torchrun_gives_them(tmp_path):
    argv = ["--nproc_per_node=2", "--nnodes=1:2", "--rdzv_backend=c10d",
            "--rdzv-endpoint=198.18.0.1:29400", "--rdzv_id=job7",
            "--rdzv-conf=join_timeout=30,read_timeout=70", "--max_restarts=3",
            "--monitor_interval=0.5", "--role=trainer", "--signals_to_handle=SIGTERM,SIGUSR1",
            "--local_addr=198.18.0.2"]
    theirs, ours = _configs(tmp_path, argv)
    for field in ("nproc_per_node", "min_nodes", "max_nodes", "run_id", "role", "rdzv_backend",
                  "rdzv_endpoint", "max_restarts", "monitor_interval", "signals_to_handle",
                  "local_addr"):
        assert getattr(ours, field) == getattr(theirs, field), field
    for key, value in theirs.rdzv_configs.items():
        assert str(ours.rdzv_configs[key]) == str(value), key


@pytest.mark.timeout(60)
def test_standalone_and_static_rendezvous(tmp_path):
    _, ours = _configs(tmp_path, ["--standalone", "--nproc_per_node=2",
                                  "--rdzv_endpoint=198.18.0.1:1", "--master_port=29600"])
    assert ours.rdzv_backend == "c10d" and ours.rdzv_endpoint == "127.0.0.1:0"
    assert (ours.min_nodes, ours.max_nodes, ours.nproc_per_node) == (1, 1, 2)
    theirs, ours = _configs(tmp_path, ["--nnodes=2", "--node_rank=1", "--rdzv_backend=static",
                                       "--master_addr=198.18.0.1", "--master_port=29500"])
    assert ours.rdzv_backend == theirs.rdzv_backend == "static"
    assert ours.rdzv_endpoint == theirs.rdzv_endpoint == "198.18.0.1:29500"
    assert ours.rdzv_configs["rank"] == theirs.rdzv_configs["rank"] == 1


@pytest.mark.timeout(60)
def test_the_shown_streams_follow_redirects_and_tee(tmp_path):
    from torch.distributed.elastic.multiprocessing import Std

    script = tmp_path / "train.py"
    script.write_text("")
    args = _shoal_run_parser().parse_args(["--nproc_per_node=3", "--redirects=3", "--tee=0:1",
                                           "--local_ranks_filter=0,2", str(script)])
    spec = spec_from_args(args, args.entry, args.args, args.module)
    # Everything is logged (the failure summary reads the logs); of what torchrun would
    # show, rank 0 shows stdout (redirected, teed back), rank 2 nothing, rank 1 is filtered.
    assert spec.agent.shown_streams(3) == {0: {"stdout"}, 1: set(), 2: set()}
    assert build_launch_config(spec, str(tmp_path)).logs_specs._redirects == Std.ALL


@pytest.mark.timeout(60)
def test_a_logs_specs_plugin_gets_the_streams_torchrun_would_show(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing import Std

    # An installed plugin (entry point group torchrun.logs_specs), here torch's own class.
    info = tmp_path / "site" / "mine_logs-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mine-logs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[torchrun.logs_specs]\nmine = torch.distributed.elastic.multiprocessing:"
        "DefaultLogsSpecs\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    script = tmp_path / "train.py"
    script.write_text("")
    args = _shoal_run_parser().parse_args(["--nproc_per_node=3", "--redirects=3", "--tee=0:1",
                                           "--logs_specs=mine", str(script)])
    specs = build_launch_config(spec_from_args(args, args.entry, args.args, args.module),
                                str(tmp_path)).logs_specs
    assert specs._redirects == Std.ALL  # everything logged; teed back: rank 0's stdout
    assert specs._tee == {0: Std.OUT, 1: Std.NONE, 2: Std.NONE}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, says", [
    (["--rdzv_backend=etcd"], "--rdzv-backend etcd: shoal meets through torch's own store"),
    (["--standalone", "--nnodes=2"], "--standalone runs on one node"),
    (["--no-python", "-m"], "--no-python runs a program, -m a Python module"),
    (["--tee=7"], "--tee takes 0, 1, 2 or 3"),
    (["--rdzv_conf=oops"], "--rdzv-conf takes KEY=VALUE"),
])
def test_what_shoal_does_not_take_is_refused_in_one_line(argv, says):
    out = run_shoal_in_process("run", *argv, "README.md")
    assert out.returncode == 2
    assert says in out.stderr and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("typed, meant", [("--nprocs", "--nproc-per-node"),
                                          ("--nproc_per_nod=2", "--nproc-per-node"),
                                          ("--max-restart", "--max-restarts")])
def test_an_unknown_flag_gets_the_nearest_one(typed, meant):
    out = run_shoal_in_process("run", typed, "README.md")
    assert out.returncode == 2
    assert f"did you mean {meant} for {typed.split('=')[0]}?" in out.stderr
    assert "(see 'shoal run --help')" in out.stderr and out.stderr.count("\n") == 1


@pytest.mark.timeout(60)
def test_pet_variables_stand_for_flags(monkeypatch):
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    monkeypatch.setenv("PET_ROLE", "trainer")
    monkeypatch.setenv("PET_RUN_PATH", "1")
    args = _shoal_run_parser().parse_args(["train.py"])
    theirs = get_args_parser().parse_args(["train.py"])
    for ns in (args, theirs):
        assert (ns.max_restarts, ns.role, ns.run_path) == (2, "trainer", True)
    # A flag still wins.
    assert _shoal_run_parser().parse_args(["--max_restarts=1", "x.py"]).max_restarts == 1
    # The job's shape is the scheduler detection's (Kubeflow's PyTorchJob), not a default.
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    assert _shoal_run_parser().parse_args(["train.py"]).nproc_per_node is None


@pytest.mark.timeout(60)
def test_help_shows_one_spelling_of_each_flag():
    text = _shoal_run_parser().format_help()
    assert "--nproc-per-node" in text and "--nproc_per_node NPROC" not in text
    assert "torchrun's spelling with underscores" in " ".join(text.split())


# What a worker sees of how it was started, one line each.
# (one write of the whole line: torchrun's workers share its stdout, where lines written
# in parts by two processes can mix)
SEEN = ("import os, sys\n"
        "line = ' '.join(map(str, ['seen', os.environ['RANK'], os.environ['WORLD_SIZE'], "
        "sys.argv, __file__, sys.path[0]]))\n"
        "os.write(1, (line + '\\n').encode())\n")
LAUNCHED = {
    # python and torchrun keep sys.argv[0] as typed (before, shoal made it absolute)
    "script as typed": (["--nproc_per_node=1", "seen.py", "a"], {}),
    # a module in the working folder, as `python -m` finds it (before: "module not found")
    "-m local module": (["--nproc_per_node=1", "-m", "seen", "a"], {}),
    # a free port chosen by the OS (before: refused, "must be HOST:PORT")
    "c10d port 0": (["--nproc_per_node=2", "--rdzv_backend=c10d",
                     "--rdzv_endpoint=localhost:0", "seen.py"], {}),
    # an empty template is no prefix (before: "[rank0]: ")
    "empty prefix template": (["--nproc_per_node=1", "seen.py"],
                              {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": ""}),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(LAUNCHED))
def test_a_command_line_launches_as_under_torchrun(case, tmp_path):
    """The same command line, in the same folder, under torchrun and under `shoal run`: the
    same exit status, and every worker sees the same (its lines, of any order)."""
    argv, env = LAUNCHED[case]
    (tmp_path / "seen.py").write_text(SEEN)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    torchrun = subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"),
                               *argv], cwd=tmp_path, capture_output=True, text=True,
                              timeout=100, env=full_env)
    shoal = run_shoal("run", *argv, cwd=str(tmp_path), env=env, timeout=100)
    assert shoal.returncode == torchrun.returncode == 0, (shoal.stderr, torchrun.stderr)
    theirs = sorted(torchrun.stdout.splitlines())
    ours = sorted(shoal.stdout.splitlines())
    if not env:  # shoal names each line's rank, where torchrun shows none
        ours = sorted(re.sub(r"^\[rank\d+\]: ", "", line) for line in ours)
    assert len(theirs) == int(argv[0].split("=")[1]) and ours == theirs, (ours, theirs)
