"""Job files for cluster schedulers: an sbatch script, Kubernetes manifests.

Pure text builders: `shoal slurm` and `shoal k8s` print what these return. Each job runs one
`shoal train` per node, which reads the scheduler's variables (shoal.clusters.detect) and
starts the node's workers.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.errors import UsageError

if TYPE_CHECKING:  # the schema imports torch's checkpointing: not needed to parse flags
    from shoal.config.schema import RLRunConfig, RunConfig

PREEMPTED_EXIT_CODE = 128 + 10  # SIGUSR1: what shoal train exits with after saving
K8S_KINDS = ("pytorchjob", "indexed-job", "all")
_TIME = re.compile(r"(?:(\d+)-)?(\d+):([0-5]\d):([0-5]\d)")
_SLURM_NAME = re.compile(r"[A-Za-z0-9._-]+")
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # DNS-1035, as Services need
_CONFIG_DIR = "/etc/shoal"
CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def _time_seconds(value: str) -> int:
    match = _TIME.fullmatch(value)
    if match is None:
        raise UsageError(f"--time must be HH:MM:SS or D-HH:MM:SS, got {value!r}")
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def _check_count(flag: str, value: int | None, minimum: int) -> None:
    if value is not None and value < minimum:
        raise UsageError(f"{flag} must be at least {minimum}, got {value}")


@dataclass
class SlurmJob:
    """An sbatch script: `shoal train` on N nodes, requeued after a time-limit warning."""

    config: str
    """The run config, as `shoal train --config` reads it (relative to ``workdir``)."""
    nodes: int
    """Nodes to allocate; one `shoal train` task runs on each."""
    overrides: list[str] = field(default_factory=list)
    """``key.sub=value`` overrides passed to `shoal train`."""
    gpus_per_node: int = 0
    """GPUs per node; also the workers per node (1 worker when 0) unless ``workers`` is set."""
    workers: int | None = None
    """Workers per node; ``gpus_per_node`` (1 when 0) if None."""
    cpus_per_task: int | None = None
    """CPUs for each node's task (its workers share them); the cluster's default if None."""
    time: str | None = None
    """Time limit, HH:MM:SS or D-HH:MM:SS; the partition's default if None."""
    partition: str | None = None
    """Partition (queue); the cluster's default if None."""
    job_name: str = "shoal"
    """Job name, also the log file's: JOB_NAME-JOBID.out."""
    account: str | None = None
    """Account charged; the user's default if None."""
    signal_seconds: int = 120
    """SIGUSR1 this many seconds before the time limit: time to finish a step and save."""
    workdir: str | None = None
    """Directory the job runs in (sbatch --chdir); sbatch's own default if None."""

    def __post_init__(self) -> None:
        _check_count("--nodes", self.nodes, 1)
        _check_count("--gpus-per-node", self.gpus_per_node, 0)
        _check_count("--nproc-per-node", self.workers, 1)
        _check_count("--cpus-per-task", self.cpus_per_task, 1)
        if not 1 <= self.signal_seconds <= 65535:
            raise UsageError(f"--signal-seconds must be in 1..65535, got {self.signal_seconds}")
        if self.time is not None and _time_seconds(self.time) <= self.signal_seconds:
            raise UsageError(f"--time {self.time} must be longer than --signal-seconds "
                             f"{self.signal_seconds}")
        for flag, value in (("--job-name", self.job_name), ("--partition", self.partition),
                            ("--account", self.account)):
            if value is not None and not _SLURM_NAME.fullmatch(value):
                raise UsageError(f"{flag} may hold letters, digits, '.', '_' and '-' only, "
                                 f"got {value!r}")

    @property
    def nproc_per_node(self) -> int:
        return self.workers or self.gpus_per_node or 1


def requeue_overrides(config: RunConfig | RLRunConfig) -> list[str]:
    """What a requeued job needs to continue where it stopped: ``resume=auto``, and a
    checkpoint directory (RUN_DIR/checkpoints) when the config names none, in its
    ``trainer`` section (or ``rl``, for a reinforcement learning run)."""
    from shoal.config.schema import RunConfig  # loaded already: the config is one

    section = "trainer" if isinstance(config, RunConfig) else "rl"
    settings = config.trainer if isinstance(config, RunConfig) else config.rl
    if settings.resume not in (None, "auto"):
        raise UsageError(f"{section}.resume is {settings.resume!r}: a requeued job must resume "
                         "from its own newest checkpoint (resume=auto, which shoal slurm "
                         "sets); remove it from the config")
    extra = []
    if settings.checkpoint_dir is None:
        assert config.run.dir is not None  # the loader sets it
        extra.append(f"{section}.checkpoint_dir={Path(config.run.dir) / 'checkpoints'}")
    if settings.resume is None:
        extra.append(f"{section}.resume=auto")
    return extra


def sbatch_script(job: SlurmJob) -> str:
    """The batch script, ready for ``sbatch``."""
    options = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", "--ntasks-per-node=1"]
    if job.gpus_per_node:
        options.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_task:
        options.append(f"--cpus-per-task={job.cpus_per_task}")
    for name in ("time", "partition", "account"):
        if getattr(job, name):
            options.append(f"--{name}={getattr(job, name)}")
    if job.workdir and not re.search(r"\s", job.workdir):
        options.append(f"--chdir={job.workdir}")
    # Not B:USR1: that would signal the batch shell only; this one reaches every task.
    options += [f"--output={job.job_name}-%j.out", "--open-mode=append", "--requeue",
                f"--signal=USR1@{job.signal_seconds}"]
    srun = ["srun"]
    if job.cpus_per_task:
        srun.append(f"--cpus-per-task={job.cpus_per_task}")  # srun no longer inherits it
    srun += ["shoal", "train", "--config", job.config,
             "--nproc-per-node", str(job.nproc_per_node), *job.overrides]
    lines = [
        "#!/bin/bash",
        f"# Written by `shoal slurm`: {_plural(job.nodes, 'node')} x "
        f"{_plural(job.nproc_per_node, 'worker')}. Submit with:",
        "#   sbatch THIS_FILE",
        *(f"#SBATCH {option}" for option in options),
        "set -euo pipefail",
        "",
        "# One `shoal train` per node: it reads the nodes, its node's rank and the master from",
        "# SLURM's variables. SIGUSR1 comes before the time limit: the workers save a",
        f"# checkpoint and exit {PREEMPTED_EXIT_CODE}; the job is requeued and resumes from it.",
        "status=0",
        " ".join(shlex.quote(arg) for arg in srun) + " || status=$?",
        f'if [ "$status" -eq {PREEMPTED_EXIT_CODE} ]; then',
        '    echo "shoal: checkpoint saved before the time limit; requeueing job '
        '$SLURM_JOB_ID" >&2',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    exit 0",
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


@dataclass
class K8sJob:
    """Kubernetes manifests running `shoal train` on N pods, one per node."""

    name: str
    """Name of the job (and of its service and config map); a DNS label starting with a
    letter."""
    config_text: str
    """The run config's contents, shipped in a ConfigMap."""
    nodes: int
    """Pods, one `shoal train` on each."""
    config_name: str = "run.yaml"
    """File name of the config inside the pod (its stem names the default run directory)."""
    overrides: list[str] = field(default_factory=list)
    """``key.sub=value`` overrides passed to `shoal train`."""
    nproc_per_node: int = 1
    """Workers per pod."""
    gpus_per_node: int = 0
    """GPUs each pod requests (nvidia.com/gpu)."""
    image: str = "shoal:latest"
    """Container image with shoal (and the code the config names) installed."""
    kind: str = "pytorchjob"
    """'pytorchjob' (Kubeflow), 'indexed-job' (a plain Job and a headless Service), or 'all'."""
    port: int = 29500
    """Rendezvous port on pod 0."""

    def __post_init__(self) -> None:
        _check_count("--nodes", self.nodes, 1)
        _check_count("--nproc-per-node", self.nproc_per_node, 1)
        _check_count("--gpus-per-node", self.gpus_per_node, 0)
        if self.kind not in K8S_KINDS:
            raise UsageError(f"--kind must be one of {', '.join(K8S_KINDS)}, got {self.kind!r}")
        # Pods are NAME-INDEX (and NAME-master-0): each must stay a DNS label.
        longest = len(f"{self.name}-master-0-{self.nodes}")
        if not _DNS_LABEL.fullmatch(self.name) or longest > 63:
            raise UsageError(f"--name must be lower-case letters, digits and '-' (a DNS "
                             f"label, short enough for its pod names), got {self.name!r}")
        if not CONFIG_KEY.fullmatch(self.config_name):
            raise UsageError(f"config file name {self.config_name!r} cannot be a ConfigMap "
                             "key (letters, digits, '-', '_', '.')")


def _container(job: K8sJob, env: dict[str, str]) -> dict:
    container: dict[str, object] = {
        "name": "pytorch",  # the name Kubeflow's operator looks for
        "image": job.image,
        "command": ["shoal", "train", "--config", f"{_CONFIG_DIR}/{job.config_name}",
                    "--nproc-per-node", str(job.nproc_per_node), *job.overrides],
        "volumeMounts": [{"name": "config", "mountPath": _CONFIG_DIR, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if env:
        container["env"] = [{"name": key, "value": value} for key, value in env.items()]
    if job.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": job.gpus_per_node}}
    return container


def _pod_spec(job: K8sJob, env: dict[str, str]) -> dict:
    return {
        "containers": [_container(job, env)],
        "volumes": [
            {"name": "config", "configMap": {"name": f"{job.name}-config"}},
            # Docker's 64 MB /dev/shm is too small for NCCL and DataLoader workers.
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }


def _config_map(job: K8sJob) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{job.name}-config"},
            "data": {job.config_name: job.config_text}}


def _pytorchjob(job: K8sJob) -> dict:
    def replicas(count: int) -> dict:
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"spec": _pod_spec(job, {})}}

    specs = {"Master": replicas(1)}
    if job.nodes > 1:
        specs["Worker"] = replicas(job.nodes - 1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": job.name},
            "spec": {"nprocPerNode": str(job.nproc_per_node), "pytorchReplicaSpecs": specs}}


def _indexed_job(job: K8sJob) -> list[dict]:
    labels = {"shoal-job": job.name}
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": job.name},
        # Headless: pod INDEX gets the DNS name NAME-INDEX.NAME, before it is ready, too.
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels,
                 "ports": [{"name": "rendezvous", "port": job.port}]},
    }
    env = {"SHOAL_NNODES": str(job.nodes), "SHOAL_MASTER_ADDR": f"{job.name}-0.{job.name}",
           "SHOAL_MASTER_PORT": str(job.port)}
    pod = {**_pod_spec(job, env), "subdomain": job.name, "restartPolicy": "OnFailure"}
    batch_job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": job.name},
        "spec": {"completionMode": "Indexed", "completions": job.nodes,
                 "parallelism": job.nodes, "backoffLimit": 3,
                 "template": {"metadata": {"labels": labels}, "spec": pod}},
    }
    return [service, batch_job]


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def _dumper() -> type:
    """A YAML dumper that writes multi-line strings (the config file) as literal blocks,
    readable in the output, and no aliases (&id001) for objects used twice. (yaml is
    imported here: every `shoal` command imports this module, and yaml takes 70 ms.)"""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True

    Dumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
        "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))
    return Dumper


def k8s_manifests(job: K8sJob) -> str:
    """The YAML documents to ``kubectl apply -f``: the ConfigMap, then the job(s)."""
    docs = [_config_map(job)]
    if job.kind in ("pytorchjob", "all"):
        docs.append(_pytorchjob(job))
    if job.kind in ("indexed-job", "all"):
        docs += _indexed_job(job)
    header = (f"# Written by `shoal k8s`: {_plural(job.nodes, 'pod')} x "
              f"{_plural(job.nproc_per_node, 'worker')}.\n"
              + ("# --kind all: the PyTorchJob and the Indexed Job are alternatives; apply "
                 "one.\n" if job.kind == "all" else ""))
    import yaml

    return header + yaml.dump_all(docs, Dumper=_dumper(), sort_keys=False, explicit_start=True)
