"""Scheduler detection from recorded environments: SLURM, Open MPI, MPICH, Kubernetes,
SkyPilot, torchrun."""

from __future__ import annotations

import pytest

from shoal.clusters.detect import detect
from shoal.clusters.hostlist import expand_hostlist, expand_tasks_per_node, first_host
from shoal.errors import UsageError
from shoal.launch.direct import worker_environment

# srun inside `sbatch --nodes=2 --ntasks-per-node=4`: what task 5 (node 1, local 1) sees.
SLURM_2x4 = {
    "SLURM_JOB_ID": "81234", "SLURM_JOBID": "81234", "SLURM_JOB_NAME": "shoal-digits",
    "SLURM_JOB_NODELIST": "gpu-node[07-08]", "SLURM_NODELIST": "gpu-node[07-08]",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_NTASKS": "8", "SLURM_NPROCS": "8",
    "SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_CPUS_PER_NODE": "32(x2)", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
    "SLURM_STEP_NODELIST": "gpu-node[07-08]", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_NODEID": "1", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_GTIDS": "4,5,6,7",
    "SLURMD_NODENAME": "gpu-node08", "SLURM_SUBMIT_DIR": "/home/ada/run",
}
# srun inside `sbatch --nodes=2 --ntasks-per-node=1`: node 1.
SLURM_2x1 = {
    "SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "node[001-002]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "node[001-002]",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1", "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0", "SLURMD_NODENAME": "node002",
}
# mpirun -np 8 --hostfile (2 hosts x 4 slots), Open MPI 4: rank 6.
OPENMPI_4 = {
    "OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "OMPI_COMM_WORLD_NODE_RANK": "2", "OMPI_UNIVERSE_SIZE": "8",
    "OMPI_MCA_orte_hnp_uri": "3826384896.0;tcp://10.0.0.1,10.1.0.1:39245",
    "OMPI_MCA_orte_ess_num_procs": "8", "PMIX_RANK": "6",
    "PMIX_SERVER_URI2": "3826384896.1;tcp4://127.0.0.1:43123",
}
# Open MPI 5 (PRRTE): no hnp uri; rank 1, on mpirun's own host.
OPENMPI_5 = {
    "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "OMPI_VERSION": "5.0.3", "PMIX_NAMESPACE": "prterun-host-1234@1", "PMIX_RANK": "1",
    "PMIX_SERVER_URI41": "prterun-host-1234@0.0;tcp4://10.0.0.1:39245",
    "PMIX_SERVER_URI4": "prterun-host-1234@0.0;tcp4://10.0.0.1:39245",
    "PMIX_SERVER_URI3": "prterun-host-1234@0.0;tcp4://10.0.0.1:39245",
    "PMIX_SERVER_URI2": "prterun-host-1234@0.0;tcp4://10.0.0.1:39245",
    "PMIX_SERVER_URI21": "prterun-host-1234@0.0;tcp4://10.0.0.1:39245",
}
# mpiexec.hydra -n 8 -ppn 4 (MPICH, Intel MPI): rank 4 on the second node.
HYDRA = {
    "PMI_RANK": "4", "PMI_SIZE": "8", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4",
    "PMI_FD": "6", "PMI_PORT": "node02:36911", "HYDI_CONTROL_FD": "8",
}
# Kubeflow training-operator, PyTorchJob with 1 master + 2 workers, nprocPerNode 4: worker 1.
PYTORCHJOB_WORKER = {
    "PET_NNODES": "3", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "2",
    "PET_MASTER_ADDR": "digits-master-0", "PET_MASTER_PORT": "23456",
    "MASTER_ADDR": "digits-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "12", "RANK": "2",
    "PYTHONUNBUFFERED": "1",
}
# The Indexed Job written by `shoal k8s --kind indexed-job --name digits --nodes 3`: pod 1.
INDEXED_JOB = {
    "JOB_COMPLETION_INDEX": "1", "SHOAL_NNODES": "3", "SHOAL_MASTER_ADDR": "digits-0.digits",
    "SHOAL_MASTER_PORT": "29500", "HOSTNAME": "digits-1",
}
# SkyPilot, `num_nodes: 2` with `accelerators: H100:8`: what the run command sees on node 1.
SKYPILOT_NODE_1 = {
    "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.128.0.12\n10.128.0.13\n",
    "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "8",
    "SKYPILOT_TASK_ID": "sky-2026-12-02-digits", "SKYPILOT_CLUSTER_INFO": "{}",
}
# torchrun --nnodes 2 --nproc-per-node 4: worker 5 (node 1, local 1).
TORCHRUN = {
    "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "5", "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job42", "TORCHELASTIC_RESTART_COUNT": "0",
}


def test_plain_machine_detects_nothing():
    assert detect({}) is None
    assert detect({"HOME": "/root", "RANK": "0", "SLURM_JOB_ID": "12"}) is None  # salloc shell


def test_slurm_one_task_per_node_is_per_node():
    env = detect(SLURM_2x1)
    assert (env.kind, env.per_process, env.nnodes, env.node_rank) == ("slurm", False, 2, 1)
    assert (env.master_addr, env.master_port) == ("node001", 20000 + 1234)
    assert env.nproc_per_node is None and env.label == "SLURM job 1234"


def test_slurm_several_tasks_per_node_is_per_process():
    env = detect(SLURM_2x4)
    assert env.per_process
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert (env.node_rank, env.nnodes) == (1, 2)
    assert (env.master_addr, env.master_port) == ("gpu-node07", 20000 + 81234 % 20000)
    assert worker_environment(env) == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "MASTER_ADDR": "gpu-node07", "MASTER_PORT": "21234"}


def test_slurm_master_variables_win():
    env = detect({**SLURM_2x4, "MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "29400"})
    assert (env.master_addr, env.master_port) == ("10.9.9.9", 29400)


def test_slurm_step_on_part_of_the_allocation():
    # `srun -N 2 -n 7` inside a 4-node allocation: the step's variables describe the job.
    env = detect({**SLURM_2x4, "SLURM_JOB_NODELIST": "a[1-4]", "SLURM_NNODES": "4",
                  "SLURM_STEP_NODELIST": "a[3-4]", "SLURM_STEP_NUM_TASKS": "7",
                  "SLURM_NTASKS": "7", "SLURM_STEP_TASKS_PER_NODE": "4,3",
                  "SLURM_PROCID": "6", "SLURM_LOCALID": "2"})
    assert (env.master_addr, env.nnodes, env.world_size, env.local_world_size) == ("a3", 2, 7, 3)
    assert (env.node_rank, env.nnodes) == (1, 2)


def test_slurm_without_step_variables_uses_the_job_ones():
    minimal = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
               "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_LOCALID": "3",
               "SLURM_JOB_NODELIST": "login"}
    env = detect(minimal)
    assert (env.rank, env.local_world_size, env.master_addr, env.master_port) == (
        3, 4, "login", 20007)


def test_open_mpi_4_master_is_mpiruns_host():
    env = detect(OPENMPI_4)
    assert (env.kind, env.per_process, env.rank, env.local_rank) == ("openmpi", True, 6, 2)
    assert (env.world_size, env.local_world_size, env.node_rank, env.nnodes) == (8, 4, 1, 2)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29500)


def test_open_mpi_ipv6_uri():
    env = detect({**OPENMPI_4, "OMPI_MCA_orte_hnp_uri":
                  "1314521088.0;tcp6://[fe80::b9b:ac5d:9cf0:b858,2620:10d:c083::2]:43370"})
    assert env.master_addr == "fe80::b9b:ac5d:9cf0:b858"


def test_open_mpi_5_pmix_server_of_mpirun():
    env = detect(OPENMPI_5)
    assert (env.master_addr, env.rank, env.node_rank) == ("10.0.0.1", 1, 0)


@pytest.mark.parametrize("uri", ["prterun-host-1234@0.1;tcp4://10.0.0.2:39245",  # own daemon
                                 "prterun-host-1234@0.0;tcp4://127.0.0.1:39245"])  # loopback
def test_open_mpi_5_without_mpiruns_address_asks_for_master_addr(uri):
    env = {k: v for k, v in OPENMPI_5.items() if not k.startswith("PMIX_SERVER_URI")}
    with pytest.raises(UsageError, match="MASTER_ADDR.*mpirun -x MASTER_ADDR=<host>"):
        detect({**env, "PMIX_SERVER_URI2": uri})
    assert detect({**env, "PMIX_SERVER_URI2": uri, "MASTER_ADDR": "n1"}).master_addr == "n1"


def test_open_mpi_on_one_node_uses_loopback():
    env = detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (env.master_addr, env.nnodes, env.node_rank) == ("127.0.0.1", 1, 0)


def test_mpirun_inside_slurm_is_mpi():
    # mpirun starts its daemons with srun: the ranks carry the daemons' SLURM variables.
    daemon = {**SLURM_2x1, "SLURM_NODEID": "1", "SLURM_PROCID": "1"}
    assert detect({**daemon, **OPENMPI_4}).kind == "openmpi"


def test_hydra_mpich_and_intel_mpi():
    env = detect({**HYDRA, "MASTER_ADDR": "node01"})
    assert (env.kind, env.rank, env.local_rank, env.world_size) == ("mpich", 4, 0, 8)
    assert (env.node_rank, env.nnodes, env.master_addr, env.master_port) == (1, 2, "node01",
                                                                             29500)
    with pytest.raises(UsageError, match="mpiexec -genv MASTER_ADDR <host>"):
        detect(HYDRA)


def test_uneven_mpi_layout_leaves_nodes_unknown():
    env = detect({**HYDRA, "PMI_SIZE": "6", "MPI_LOCALNRANKS": "4", "MASTER_ADDR": "h"})
    assert (env.nnodes, env.node_rank) == (None, None)
    assert "GROUP_RANK" not in worker_environment(env)


def test_kubeflow_pytorchjob():
    env = detect(PYTORCHJOB_WORKER)
    assert (env.kind, env.per_process, env.nnodes, env.node_rank) == ("pytorchjob", False, 3, 2)
    assert (env.master_addr, env.master_port, env.nproc_per_node) == (
        "digits-master-0", 23456, 4)
    assert detect({**PYTORCHJOB_WORKER, "PET_NNODES": "3:3",
                   "PET_NPROC_PER_NODE": "auto"}).nproc_per_node == "auto"
    older = {k: v for k, v in PYTORCHJOB_WORKER.items() if k not in (
        "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_NPROC_PER_NODE")}
    env = detect(older)  # operators before PET_NODE_RANK: RANK is the replica's rank
    assert (env.node_rank, env.master_addr, env.nproc_per_node) == (2, "digits-master-0", None)


def test_indexed_job():
    env = detect(INDEXED_JOB)
    assert (env.kind, env.per_process, env.nnodes, env.node_rank) == (
        "k8s-indexed-job", False, 3, 1)
    assert (env.master_addr, env.master_port) == ("digits-0.digits", 29500)


def test_skypilot():
    env = detect(SKYPILOT_NODE_1)
    assert (env.kind, env.per_process, env.nnodes, env.node_rank) == ("skypilot", False, 2, 1)
    assert (env.master_addr, env.master_port, env.nproc_per_node) == ("10.128.0.12", 29500, 8)
    cpu = {**SKYPILOT_NODE_1, "SKYPILOT_NUM_GPUS_PER_NODE": "0", "MASTER_PORT": "8008"}
    del cpu["SKYPILOT_NUM_NODES"]  # (the addresses count the nodes)
    env = detect(cpu)
    assert (env.nnodes, env.master_port, env.nproc_per_node) == (2, 8008, None)


def test_torchrun_worker_wins_over_slurm():
    # A torchrun agent started by srun: its workers carry both sets of variables.
    env = detect({**SLURM_2x1, **TORCHRUN})
    assert (env.kind, env.per_process, env.rank, env.local_rank) == ("torchrun", True, 5, 1)
    assert (env.node_rank, env.nnodes, env.master_addr) == (1, 2, "10.0.0.1")


def test_plain_torchrun_variables():
    plain = {k: v for k, v in TORCHRUN.items() if not k.startswith(("TORCHELASTIC", "GROUP",
                                                                     "LOCAL_WORLD"))}
    env = detect(plain)
    assert (env.kind, env.rank, env.world_size, env.local_world_size) == ("torchrun", 5, 8, None)
    assert set(worker_environment(env)) == {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                            "MASTER_PORT"}


@pytest.mark.parametrize("base, change, names", [
    (SLURM_2x4, {"SLURM_PROCID": "five"}, "SLURM_PROCID='five'"),
    (SLURM_2x4, {"SLURM_PROCID": "8"}, "SLURM_PROCID='8' must be less than"),
    (SLURM_2x4, {"SLURM_LOCALID": "4"}, "SLURM_LOCALID='4'"),
    (SLURM_2x4, {"SLURM_NODEID": "2"}, "SLURM_NODEID='2'"),
    (SLURM_2x4, {"SLURM_STEP_NODELIST": "gpu-node[07-"}, "SLURM_STEP_NODELIST='gpu-node"),
    (SLURM_2x4, {"SLURM_STEP_TASKS_PER_NODE": "4(x3)"}, "SLURM_STEP_TASKS_PER_NODE"),
    (SLURM_2x4, {"SLURM_STEP_TASKS_PER_NODE": "four"}, "SLURM_STEP_TASKS_PER_NODE='four'"),
    (SLURM_2x4, {"MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
    (SLURM_2x4, {"SLURM_JOB_ID": "12a"}, "SLURM_JOB_ID='12a'"),
    (SLURM_2x1, {"SLURM_STEP_NUM_TASKS": "1"}, "SLURM_STEP_NUM_TASKS=1 is less than"),
    (OPENMPI_4, {"OMPI_COMM_WORLD_RANK": "8"}, "OMPI_COMM_WORLD_RANK='8'"),
    (OPENMPI_4, {"OMPI_COMM_WORLD_LOCAL_RANK": "-1"}, "OMPI_COMM_WORLD_LOCAL_RANK='-1'"),
    (OPENMPI_4, {"OMPI_MCA_orte_hnp_uri": "garbage"}, "OMPI_MCA_orte_hnp_uri='garbage'"),
    (HYDRA, {"PMI_SIZE": "0"}, "PMI_SIZE='0'"),
    (PYTORCHJOB_WORKER, {"PET_NNODES": "1:4"}, "PET_NNODES='1:4'"),
    (PYTORCHJOB_WORKER, {"PET_NODE_RANK": "3"}, "PET_NODE_RANK='3'"),
    (PYTORCHJOB_WORKER, {"PET_NPROC_PER_NODE": "gpu"}, "PET_NPROC_PER_NODE='gpu'"),
    (INDEXED_JOB, {"JOB_COMPLETION_INDEX": "3"}, "JOB_COMPLETION_INDEX='3'"),
    (INDEXED_JOB, {"SHOAL_MASTER_PORT": "http"}, "SHOAL_MASTER_PORT='http'"),
    (TORCHRUN, {"WORLD_SIZE": "2"}, "RANK='5' must be less than WORLD_SIZE=2"),
    (SKYPILOT_NODE_1, {"SKYPILOT_NODE_RANK": "2"}, "SKYPILOT_NODE_RANK='2'"),
    (SKYPILOT_NODE_1, {"SKYPILOT_NUM_NODES": "3"}, "SKYPILOT_NUM_NODES=3 but SKYPILOT_NODE_IPS"),
    (SKYPILOT_NODE_1, {"SKYPILOT_NODE_IPS": ""}, "SKYPILOT_NODE_IPS is not set"),
    (SKYPILOT_NODE_1, {"SKYPILOT_NUM_GPUS_PER_NODE": "eight"},
     "SKYPILOT_NUM_GPUS_PER_NODE='eight'"),
])
def test_malformed_values_name_the_variable(base, change, names):
    with pytest.raises(UsageError) as caught:
        detect({**base, **change})
    assert names in str(caught.value)


def test_missing_variables_are_named():
    with pytest.raises(UsageError, match="OMPI_COMM_WORLD_LOCAL_SIZE is not set"):
        detect({k: v for k, v in OPENMPI_4.items() if k != "OMPI_COMM_WORLD_LOCAL_SIZE"})
    with pytest.raises(UsageError, match="SHOAL_MASTER_ADDR is not set"):
        detect({k: v for k, v in INDEXED_JOB.items() if k != "SHOAL_MASTER_ADDR"})
    with pytest.raises(UsageError, match="SLURM_NTASKS is not set"):
        detect({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NNODES": "1"})


@pytest.mark.parametrize("text, hosts", [
    ("login", ["login"]),
    ("n1,n2", ["n1", "n2"]),
    ("node[001-004,007],gpu-a[1-2]",
     ["node001", "node002", "node003", "node004", "node007", "gpu-a1", "gpu-a2"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("c[8-10]", ["c8", "c9", "c10"]),
    ("gpu-node[07-08],login", ["gpu-node07", "gpu-node08", "login"]),
])
def test_hostlist_expansion(text, hosts):
    assert list(expand_hostlist(text)) == hosts
    assert first_host(text) == hosts[0]


def test_first_host_of_a_huge_list_is_quick():
    assert first_host("n[000001-999999],m[1-999999]") == "n000001"


@pytest.mark.parametrize("text", ["", "node[1-", "node]1[", "n[1-2]]", "n[2-1]", "n[a-b]",
                                  "n[]", "a,,b", "n[1-[2]]"])
def test_bad_hostlists_are_refused(text):
    with pytest.raises(ValueError):
        list(expand_hostlist(text))


def test_tasks_per_node():
    assert expand_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert expand_tasks_per_node("2") == [2]
    for bad in ("", "4(x)", "x2", "4(2)"):
        with pytest.raises(ValueError):
            expand_tasks_per_node(bad)
