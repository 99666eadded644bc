"""`shoal slurm` and `shoal k8s`: the job files they print, and the inputs they refuse."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess

import pytest
import yaml

from shoal.cli.main import main
from shoal.clusters.detect import detect
from shoal.clusters.jobscripts import (
    K8sJob,
    SlurmJob,
    k8s_manifests,
    requeue_overrides,
    sbatch_script,
)
from shoal.config.loader import load_run_config
from shoal.errors import UsageError

DIGITS = "examples/digits.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _srun_line(script: str) -> list[str]:
    line = next(line for line in script.splitlines() if line.startswith("srun "))
    return shlex.split(line.removesuffix(" || status=$?"))


def test_sbatch_script_is_valid_bash_with_the_right_options(capsys, tmp_path):
    code, script, err = _cli(capsys, "slurm", "--config", DIGITS, "--nodes", "2",
                             "--gpus-per-node", "4", "--time", "04:00:00", "--partition",
                             "gpu", "--account", "proj1", "trainer.epochs=3",
                             "--cpus-per-task", "16")
    assert code == 0, err
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    options = [line.split(" ", 1)[1] for line in script.splitlines()
               if line.startswith("#SBATCH ")]
    assert options == [
        "--job-name=shoal-digits", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4",
        "--cpus-per-task=16", "--time=04:00:00", "--partition=gpu", "--account=proj1",
        f"--chdir={os.getcwd()}", "--output=shoal-digits-%j.out", "--open-mode=append",
        "--requeue", "--signal=USR1@120"]
    assert script.startswith("#!/bin/bash\n") and "set -euo pipefail" in script
    assert _srun_line(script) == [
        "srun", "--cpus-per-task=16", "shoal", "train", "--config", DIGITS,
        "--nproc-per-node", "4", "trainer.epochs=3",
        "trainer.checkpoint_dir=runs/digits/checkpoints", "trainer.resume=auto"]
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script


def test_requeue_keeps_the_configs_checkpoint_dir():
    config = load_run_config(DIGITS, ["trainer.checkpoint_dir=/ckpt"])
    assert requeue_overrides(config) == ["trainer.resume=auto"]
    config = load_run_config(DIGITS, ["trainer.checkpoint_dir=/ckpt", "trainer.resume=auto"])
    assert requeue_overrides(config) == []


def test_sbatch_of_a_reinforcement_learning_run_resumes_its_rl_section(capsys):
    config = load_run_config("examples/cartpole.yaml")  # it names both
    assert requeue_overrides(config) == []
    unset = ["rl.checkpoint_dir=null", "rl.resume=null", "rl.checkpoint_every=null"]
    code, script, err = _cli(capsys, "slurm", "--config", "examples/cartpole.yaml",
                             "--nodes", "1", *unset)
    assert code == 0, err
    assert _srun_line(script)[-5:] == [*unset, "rl.checkpoint_dir=runs/cartpole/checkpoints",
                                       "rl.resume=auto"]


def test_sbatch_without_gpus_runs_one_worker_per_node():
    script = sbatch_script(SlurmJob(config=DIGITS, nodes=1))
    assert "--gpus-per-node" not in script and "--time" not in script
    assert _srun_line(script) == ["srun", "shoal", "train", "--config", DIGITS,
                                  "--nproc-per-node", "1"]
    script = sbatch_script(SlurmJob(config=DIGITS, nodes=2, workers=3))
    assert "# Written by `shoal slurm`: 2 nodes x 3 workers." in script
    assert _srun_line(script)[-2:] == ["--nproc-per-node", "3"]


@pytest.mark.parametrize("srun_code, scontrol_args, script_code", [
    (138, "requeue 77", 0),  # the time-limit warning: checkpoint saved, requeue
    (1, None, 1),            # a failure: no requeue, the job fails
    (0, None, 0),
])
def test_sbatch_requeues_only_after_the_time_limit_warning(tmp_path, srun_code, scontrol_args,
                                                           script_code):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", f"exit {srun_code}"),
                       ("scontrol", f'echo "$@" > {tmp_path}/scontrol.args')):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(stat.S_IRWXU)
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(SlurmJob(config=DIGITS, nodes=2)))
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                               "SLURM_JOB_ID": "77"})
    assert done.returncode == script_code, done.stderr
    args_file = tmp_path / "scontrol.args"
    assert (args_file.read_text().strip() if args_file.exists() else None) == scontrol_args


def _manifests(kind: str, **changes) -> list[dict]:
    job = K8sJob(name="digits", config_text=open(DIGITS).read(), nodes=3,
                 config_name="digits.yaml", nproc_per_node=4, gpus_per_node=4,
                 image="registry.example/shoal:1", kind=kind, **changes)
    return list(yaml.safe_load_all(k8s_manifests(job)))


def _container(pod_spec: dict) -> dict:
    (container,) = pod_spec["containers"]
    return container


def test_pytorchjob_manifest():
    config_map, job = _manifests("pytorchjob", overrides=["trainer.epochs=2"])
    assert (config_map["kind"], config_map["metadata"]["name"]) == ("ConfigMap", "digits-config")
    assert config_map["data"]["digits.yaml"] == open(DIGITS).read()
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == (
        "kubeflow.org/v1", "PyTorchJob", "digits")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 2)
    assert job["spec"]["nprocPerNode"] == "4"
    for spec in replicas.values():
        assert spec["restartPolicy"] == "OnFailure"
        pod = spec["template"]["spec"]
        container = _container(pod)
        assert (container["name"], container["image"]) == ("pytorch", "registry.example/shoal:1")
        assert container["command"] == ["shoal", "train", "--config", "/etc/shoal/digits.yaml",
                                        "--nproc-per-node", "4", "trainer.epochs=2"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert {"name": "config", "configMap": {"name": "digits-config"}} in pod["volumes"]


def test_indexed_job_manifests_and_what_each_pod_detects():
    config_map, service, job = _manifests("indexed-job")
    assert config_map["kind"] == "ConfigMap"
    assert (service["kind"], service["spec"]["clusterIP"]) == ("Service", "None")
    spec = job["spec"]
    assert (job["apiVersion"], job["kind"], spec["completionMode"]) == (
        "batch/v1", "Job", "Indexed")
    assert spec["completions"] == spec["parallelism"] == 3
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == "digits"
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    env = {item["name"]: item["value"] for item in _container(pod)["env"]}
    assert env["SHOAL_MASTER_ADDR"] == "digits-0.digits"
    # What pod 2 then reads: Kubernetes adds JOB_COMPLETION_INDEX.
    found = detect({**env, "JOB_COMPLETION_INDEX": "2"})
    assert (found.nnodes, found.node_rank, found.master_port) == (3, 2, 29500)


def test_k8s_cli_prints_every_document_of_kind_all(capsys):
    code, out, err = _cli(capsys, "k8s", "--config", DIGITS, "--name", "digits", "--nodes",
                          "1", "--kind", "all")
    assert code == 0, err
    docs = list(yaml.safe_load_all(out))
    assert [doc["kind"] for doc in docs] == ["ConfigMap", "PyTorchJob", "Service", "Job"]
    assert "Worker" not in docs[1]["spec"]["pytorchReplicaSpecs"]  # one node: master only
    assert "resources" not in _container(docs[3]["spec"]["template"]["spec"])  # no GPUs


@pytest.mark.parametrize("argv, needle", [
    (["slurm", "--config", DIGITS, "--nodes", "0"], "--nodes must be at least 1"),
    (["slurm", "--config", DIGITS, "--nodes", "1", "--nproc-per-node", "0"],
     "--nproc-per-node must be at least 1"),
    (["slurm", "--config", DIGITS, "--nodes", "2", "--time", "4h"], "--time must be HH:MM:SS"),
    (["slurm", "--config", DIGITS, "--nodes", "2", "--time", "00:01:00"],
     "longer than --signal-seconds 120"),
    (["slurm", "--config", DIGITS, "--nodes", "1", "--job-name", "a b"], "--job-name"),
    (["slurm", "--config", DIGITS, "--nodes", "1", "trainer.resume=/old/ckpt"],
     "resume /old/ckpt"),
    (["slurm", "--config", DIGITS, "--nodes", "1", "trainer.epochz=1"], "trainer.epochz"),
    (["slurm", "--config", "no/such.yaml", "--nodes", "1"], "config file not found"),
    (["slurm", "--config", DIGITS], "--nodes"),
    (["k8s", "--config", DIGITS, "--name", "Digits_1", "--nodes", "2"], "--name"),
    (["k8s", "--config", DIGITS, "--name", "d", "--nodes", "2", "--kind", "mpijob"], "--kind"),
    (["k8s", "--config", DIGITS, "--name", "d", "--nodes", "0"], "--nodes must be at least 1"),
    (["k8s", "--config", DIGITS, "--name", "d", "--nodes", "2", "--nproc-per-node", "0"],
     "--nproc-per-node must be at least 1"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err


def test_builders_validate_on_their_own():
    with pytest.raises(UsageError, match="--signal-seconds"):
        SlurmJob(config=DIGITS, nodes=1, signal_seconds=0)
    with pytest.raises(UsageError, match="--name"):
        K8sJob(name="x" * 60, config_text="", nodes=100)  # pod names over 63 characters
