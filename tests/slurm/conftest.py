"""The SLURM tests run on a real SLURM cluster across test hosts (cluster.py), or skip."""

import shutil

import pytest

from tests.multihost import hosts as test_hosts
from tests.slurm.cluster import SlurmCluster, unavailable
from tests.slurm.runs import train_locally


@pytest.fixture(scope="session")
def slurm_available():
    """Skip unless test hosts can be made and SLURM is installed."""
    why = test_hosts.unavailable() or unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture
def slurm_cluster(slurm_available, tmp_path):
    """A fresh 2-node cluster (host0, host1), removed after the test with every process."""
    with test_hosts.Hosts(2) as hosts, SlurmCluster(hosts, tmp_path / "slurm") as cluster:
        yield cluster
    shutil.rmtree(tmp_path / "slurm", ignore_errors=True)


@pytest.fixture
def mpirun():
    """The path of Open MPI's mpirun, or skip."""
    found = shutil.which("mpirun")
    if found is None:
        pytest.skip("mpirun is not installed (Debian package openmpi-bin; the README's test "
                    "command installs it)")
    return found


@pytest.fixture(scope="session")
def local_run(tmp_path_factory):
    """``local_run(nproc)``: the final state of the run on ``nproc`` processes of this
    machine, the reference each scheduler's run must equal bit for bit (trained once)."""
    done: dict[int, dict] = {}

    def run(nproc: int) -> dict:
        if nproc not in done:
            done[nproc] = train_locally(tmp_path_factory.mktemp(f"local{nproc}"), nproc)
        return done[nproc]
    return run
