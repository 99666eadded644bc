"""Where this process runs: the scheduler's variables, read once into a ``ClusterEnv``.

``detect(environ)`` returns ``None`` on a plain machine. Otherwise the job has one of two
shapes:

- per node: the scheduler started one task per node and shoal starts the workers there
  (``nnodes``, ``node_rank``, the master; ``nproc_per_node`` when the scheduler says it);
- per process: the scheduler started every worker itself (``srun --ntasks-per-node=4``,
  ``mpirun -np 8``, torchrun); shoal gives each its ranks and runs it in place.

Rules, the first that matches wins:

1. ``TORCHELASTIC_RUN_ID`` set: an elastic agent (torchrun, shoal) started this process as
   a worker; RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (and LOCAL_WORLD_SIZE,
   GROUP_RANK, GROUP_WORLD_SIZE when set) are taken as they are. Kind "torchrun", per process.
2. mpirun / mpiexec started this process. Checked before SLURM: inside an allocation mpirun
   starts its daemons with srun, so its ranks also carry SLURM variables, which describe
   the daemons (one per node), not the ranks.
   - Open MPI: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE. Kind "openmpi".
   - MPICH, Intel MPI (Hydra): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS.
     Kind "mpich".
   Per process. Node rank = rank // local size and nodes = size // local size when the size
   divides evenly (else unknown). Master: MASTER_ADDR; else 127.0.0.1 when every rank is on
   this node; else, for Open MPI, mpirun's own host, assuming rank 0 runs there (mpirun
   started on the first host of its hostfile): from OMPI_MCA_orte_hnp_uri (Open MPI 4,
   '3826384896.0;tcp://10.0.0.1,10.1.0.1:39245' gives 10.0.0.1) or from PMIX_SERVER_URI41 /
   4 / 3 / 21 / 2 when that server is mpirun's (daemon rank 0: 'prterun-h-1@0.0;tcp4://
   10.0.0.1:39245') and not on loopback. Anything else is an error asking for MASTER_ADDR.
   Port: MASTER_PORT, else 29500.
3. SLURM inside a job step (SLURM_JOB_ID and SLURM_PROCID): tasks SLURM_STEP_NUM_TASKS or
   SLURM_NTASKS; nodes SLURM_STEP_NUM_NODES, SLURM_NNODES or SLURM_JOB_NUM_NODES; node
   SLURM_NODEID; rank SLURM_PROCID, local rank SLURM_LOCALID; tasks on this node from
   SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE ('4(x2),3') or SLURM_NTASKS_PER_NODE.
   More tasks than nodes: per process; else per node. Master: MASTER_ADDR, else the first
   host of SLURM_STEP_NODELIST or SLURM_JOB_NODELIST. Port: MASTER_PORT, else
   20000 + job id % 20000, the same on every node. (The step variables come first: a step
   may use part of the job's allocation.)
4. Kubernetes, per node. Kubeflow PyTorchJob: PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK
   (or RANK), PET_MASTER_ADDR (or MASTER_ADDR), PET_MASTER_PORT (or MASTER_PORT); kind
   "pytorchjob". An Indexed Job from `shoal k8s`: JOB_COMPLETION_INDEX (the node rank),
   SHOAL_NNODES, SHOAL_MASTER_ADDR, SHOAL_MASTER_PORT; kind "k8s-indexed-job".
5. SkyPilot, per node (its ``run:`` runs once on every node): SKYPILOT_NODE_RANK,
   SKYPILOT_NODE_IPS (one address a line, the head's first: the master), SKYPILOT_NUM_NODES
   (else the count of addresses), SKYPILOT_NUM_GPUS_PER_NODE (workers per node, when more
   than 0). Port: MASTER_PORT, else 29500. Kind "skypilot".
6. RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT all set: as rule 1.

A malformed value raises UsageError naming the variable and its value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import NoReturn

from shoal.clusters import hostlist
from shoal.errors import UsageError

DEFAULT_PORT = 29500
_LOOPBACK = ("127.", "::1", "localhost")
_PMIX_URIS = ("PMIX_SERVER_URI41", "PMIX_SERVER_URI4", "PMIX_SERVER_URI3",
              "PMIX_SERVER_URI21", "PMIX_SERVER_URI2")
_LABELS = {"slurm": "SLURM", "openmpi": "Open MPI", "mpich": "MPICH/Hydra",
           "pytorchjob": "PyTorchJob", "k8s-indexed-job": "Indexed Job", "torchrun": "torchrun",
           "skypilot": "SkyPilot"}


@dataclass(frozen=True)
class ClusterEnv:
    """The job as the scheduler describes it to this process."""

    kind: str
    """'slurm', 'openmpi', 'mpich', 'pytorchjob', 'k8s-indexed-job', 'skypilot' or
    'torchrun'."""
    per_process: bool
    """True: the scheduler started every worker (run it in place); False: one task per
    node, and shoal starts the workers."""
    master_addr: str
    """Host of global rank 0, where the rendezvous store runs."""
    master_port: int
    """Port of the store on ``master_addr``."""
    nnodes: int | None
    """Number of nodes; None when the scheduler does not say (ranks spread unevenly)."""
    node_rank: int | None
    """This node's index in [0, nnodes); None when ``nnodes`` is."""
    nproc_per_node: int | str | None = None
    """Per node: workers to start on each node, a count or 'auto'; None when the scheduler
    does not say (the flag or the default decides)."""
    rank: int | None = None
    """Per process: this process's global rank."""
    local_rank: int | None = None
    """Per process: this process's rank on its node."""
    world_size: int | None = None
    """Per process: number of processes in the job."""
    local_world_size: int | None = None
    """Per process: number of processes on this node; None when the scheduler does not say."""
    job_id: str | None = None
    """The scheduler's job id (SLURM), for messages."""

    @property
    def label(self) -> str:
        """How messages name the environment: 'SLURM job 1234', 'Open MPI', ..."""
        name = _LABELS.get(self.kind, self.kind)
        return f"{name} job {self.job_id}" if self.job_id else name


def _int(env: Mapping[str, str], name: str, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None:
        raise UsageError(f"{name} is not set")
    try:
        value = int(raw.strip())
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not a whole number") from None
    if value < minimum:
        raise UsageError(f"{name}={raw!r} must be at least {minimum}")
    return value


def _first(env: Mapping[str, str], *names: str) -> str:
    """The first of ``names`` that is set (the last one, to be named in errors, if none)."""
    return next((name for name in names if name in env), names[-1])


def _below(env: Mapping[str, str], name: str, limit_name: str, limit: int) -> int:
    value = _int(env, name)
    if value >= limit:
        raise UsageError(f"{name}={env[name]!r} must be less than {limit_name}={limit}")
    return value


def _port(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    if name not in env and default is not None:
        return default
    port = _int(env, name, minimum=1)
    if port > 65535:
        raise UsageError(f"{name}={env[name]!r} must be in 1..65535")
    return port


def _per_process(kind: str, env: Mapping[str, str], names: tuple[str, str, str, str],
                 master: Callable[[bool], str], port: int) -> ClusterEnv:
    """Ranks from four variables (rank, size, local rank, local size; the last optional)."""
    rank_name, size_name, local_name, local_size_name = names
    size = _int(env, size_name, minimum=1)
    rank = _below(env, rank_name, size_name, size)
    local_size = _int(env, local_size_name, minimum=1) if local_size_name in env else None
    if local_size is not None and local_size > size:
        raise UsageError(f"{local_size_name}={local_size} must not exceed {size_name}={size}")
    local_rank = (_below(env, local_name, local_size_name, local_size) if local_size
                  else _int(env, local_name))
    node_rank = nnodes = None
    if local_size is not None and size % local_size == 0:
        node_rank, nnodes = rank // local_size, size // local_size
    return ClusterEnv(kind=kind, per_process=True, master_addr=master(local_size == size),
                      master_port=port, nnodes=nnodes, node_rank=node_rank, rank=rank,
                      local_rank=local_rank, world_size=size, local_world_size=local_size)


def _torchrun(env: Mapping[str, str]) -> ClusterEnv:
    found = _per_process("torchrun", env, ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                           "LOCAL_WORLD_SIZE"),
                         lambda _: env.get("MASTER_ADDR") or _missing("MASTER_ADDR"),
                         _port(env, "MASTER_PORT"))
    if "GROUP_RANK" in env and "GROUP_WORLD_SIZE" in env:
        nnodes = _int(env, "GROUP_WORLD_SIZE", minimum=1)
        found = replace(found, nnodes=nnodes,
                        node_rank=_below(env, "GROUP_RANK", "GROUP_WORLD_SIZE", nnodes))
    return found


def _missing(name: str) -> NoReturn:
    raise UsageError(f"{name} is not set")


def _openmpi_host(env: Mapping[str, str]) -> str | None:
    """mpirun's host from its URI, or None where the environment does not hold it."""
    uri = env.get("OMPI_MCA_orte_hnp_uri")
    if uri is not None:
        match = re.search(r"tcp://([^,:;/]+)|tcp6://\[([^,\]]+)", uri)
        if match is None:
            raise UsageError(f"OMPI_MCA_orte_hnp_uri={uri!r} holds no tcp address")
        return match.group(1) or match.group(2)
    for name in _PMIX_URIS:
        if name not in env:
            continue
        # 'NSPACE.RANK;URI': each node's ranks talk to their own daemon's server; only the
        # server of daemon 0 (mpirun itself), on a routable address, tells mpirun's host.
        server, _, uri = env[name].partition(";")
        match = re.match(r"tcp[46]?://(?:\[([^\]]+)\]|([^:/]+)):\d+", uri)
        if not server.rpartition(".")[2].isdigit() or match is None:
            raise UsageError(f"{name}={env[name]!r} is not 'NAMESPACE.RANK;tcp4://HOST:PORT'")
        host = match.group(1) or match.group(2)
        if server.rpartition(".")[2] == "0" and not host.startswith(_LOOPBACK):
            return host
        return None
    return None


def _mpi(env: Mapping[str, str], kind: str) -> ClusterEnv:
    names = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
              "OMPI_COMM_WORLD_LOCAL_SIZE") if kind == "openmpi" else
             ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))
    if names[3] not in env:
        raise UsageError(f"{names[3]} is not set ({names[0]} is)")

    def master(all_local: bool) -> str:
        if env.get("MASTER_ADDR"):
            return env["MASTER_ADDR"]
        if all_local:
            return "127.0.0.1"
        host = _openmpi_host(env) if kind == "openmpi" else None
        if host is None:
            how = ("mpirun -x MASTER_ADDR=<host>" if kind == "openmpi"
                   else "mpiexec -genv MASTER_ADDR <host>")
            raise UsageError(f"{_LABELS[kind]} ranks on several nodes and MASTER_ADDR is not "
                             "set: the environment does not tell the host of rank 0; pass "
                             f"it ({how}, or --master-addr <host>)")
        return host

    return _per_process(kind, env, names, master, _port(env, "MASTER_PORT", DEFAULT_PORT))


def _slurm(env: Mapping[str, str]) -> ClusterEnv:
    job_id = env["SLURM_JOB_ID"].strip()
    tasks_name = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    nodes_name = _first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    ntasks, nnodes = _int(env, tasks_name, minimum=1), _int(env, nodes_name, minimum=1)
    if ntasks < nnodes:
        raise UsageError(f"{tasks_name}={ntasks} is less than {nodes_name}={nnodes}")
    rank = _below(env, "SLURM_PROCID", tasks_name, ntasks)
    node_rank = _below(env, "SLURM_NODEID", nodes_name, nnodes)
    port = _port(env, "MASTER_PORT", 20000 + _int(env, "SLURM_JOB_ID") % 20000)
    addr = env.get("MASTER_ADDR")
    if not addr:
        list_name = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if list_name not in env:
            raise UsageError(f"{list_name} is not set (and MASTER_ADDR is not either)")
        try:
            addr = hostlist.first_host(env[list_name])
        except ValueError as exc:
            raise UsageError(f"{list_name}={env[list_name]!r}: {exc}") from None
    if ntasks == nnodes:
        return ClusterEnv(kind="slurm", per_process=False, master_addr=addr, master_port=port,
                          nnodes=nnodes, node_rank=node_rank, job_id=job_id)
    local_size = _tasks_on_node(env, ntasks, tasks_name, nnodes, nodes_name, node_rank)
    local_rank = _int(env, "SLURM_LOCALID")
    if local_rank >= local_size:
        raise UsageError(f"SLURM_LOCALID={env['SLURM_LOCALID']!r} must be less than the "
                         f"{local_size} tasks on this node")
    return ClusterEnv(kind="slurm", per_process=True, master_addr=addr, master_port=port,
                      nnodes=nnodes, node_rank=node_rank, rank=rank, local_rank=local_rank,
                      world_size=ntasks, local_world_size=local_size, job_id=job_id)


def _tasks_on_node(env: Mapping[str, str], ntasks: int, tasks_name: str, nnodes: int,
                   nodes_name: str, node_rank: int) -> int:
    name = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                  "SLURM_NTASKS_PER_NODE")
    if name not in env:
        if ntasks % nnodes:
            raise UsageError(f"{name} is not set and {tasks_name}={ntasks} does not divide "
                             f"evenly over {nodes_name}={nnodes}")
        return ntasks // nnodes
    try:
        counts = hostlist.expand_tasks_per_node(env[name])
    except ValueError as exc:
        raise UsageError(f"{name}={env[name]!r}: {exc}") from None
    if len(counts) == 1:  # SLURM_NTASKS_PER_NODE: one count for every node
        return counts[0]
    if len(counts) != nnodes or sum(counts) != ntasks:
        raise UsageError(f"{name}={env[name]!r} does not match {tasks_name}={ntasks} on "
                         f"{nodes_name}={nnodes}")
    return counts[node_rank]


def _nproc(env: Mapping[str, str], name: str) -> int | str | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "auto":
        return None if raw is None else "auto"
    return _int(env, name, minimum=1)


def _pytorchjob(env: Mapping[str, str]) -> ClusterEnv:
    raw = env["PET_NNODES"].strip()
    low, _, high = raw.partition(":")
    if high and low != high:
        raise UsageError(f"PET_NNODES={raw!r}: a range of nodes (elastic PyTorchJob) is not "
                         "supported; give a fixed count")
    nnodes = _int({"PET_NNODES": low}, "PET_NNODES", minimum=1)
    rank_name = _first(env, "PET_NODE_RANK", "RANK")
    addr_name = _first(env, "PET_MASTER_ADDR", "MASTER_ADDR")
    return ClusterEnv(kind="pytorchjob", per_process=False,
                      master_addr=env.get(addr_name) or _missing(addr_name),
                      master_port=_port(env, _first(env, "PET_MASTER_PORT", "MASTER_PORT")),
                      nnodes=nnodes, node_rank=_below(env, rank_name, "PET_NNODES", nnodes),
                      nproc_per_node=_nproc(env, "PET_NPROC_PER_NODE"))


def _indexed_job(env: Mapping[str, str]) -> ClusterEnv:
    nnodes = _int(env, "SHOAL_NNODES", minimum=1)
    return ClusterEnv(kind="k8s-indexed-job", per_process=False,
                      master_addr=env.get("SHOAL_MASTER_ADDR") or _missing("SHOAL_MASTER_ADDR"),
                      master_port=_port(env, "SHOAL_MASTER_PORT"), nnodes=nnodes,
                      node_rank=_below(env, "JOB_COMPLETION_INDEX", "SHOAL_NNODES", nnodes))


def _skypilot(env: Mapping[str, str]) -> ClusterEnv:
    ips = [line.strip() for line in env.get("SKYPILOT_NODE_IPS", "").splitlines()
           if line.strip()]
    if not ips:
        raise UsageError("SKYPILOT_NODE_IPS is not set (SKYPILOT_NODE_RANK is): it names the "
                         "nodes' addresses, the head's first")
    nnodes = _int(env, "SKYPILOT_NUM_NODES", minimum=1) if "SKYPILOT_NUM_NODES" in env \
        else len(ips)
    if nnodes != len(ips):
        raise UsageError(f"SKYPILOT_NUM_NODES={nnodes} but SKYPILOT_NODE_IPS names {len(ips)} "
                         "nodes")
    gpus = _int(env, "SKYPILOT_NUM_GPUS_PER_NODE") if "SKYPILOT_NUM_GPUS_PER_NODE" in env \
        else 0
    return ClusterEnv(kind="skypilot", per_process=False, master_addr=ips[0],
                      master_port=_port(env, "MASTER_PORT", DEFAULT_PORT), nnodes=nnodes,
                      node_rank=_below(env, "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES", nnodes),
                      nproc_per_node=gpus or None)


def detect(environ: Mapping[str, str] | None = None) -> ClusterEnv | None:
    """The scheduler's description of this job, or None on a plain machine (see the rules
    in this module's docstring)."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env:
        return _torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _mpi(env, "openmpi")
    if "PMI_RANK" in env and "MPI_LOCALRANKID" in env:
        return _mpi(env, "mpich")
    if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env:
        return _slurm(env)
    if "PET_NNODES" in env:
        return _pytorchjob(env)
    if "JOB_COMPLETION_INDEX" in env and "SHOAL_NNODES" in env:
        return _indexed_job(env)
    if "SKYPILOT_NODE_RANK" in env:
        return _skypilot(env)
    if all(name in env for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                    "MASTER_PORT")):
        return _torchrun(env)
    return None
