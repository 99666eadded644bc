"""The SLURM tests run on a real SLURM cluster across test hosts (cluster.py), or skip."""

import shutil

import pytest

from tests.multihost import hosts as test_hosts
from tests.slurm.cluster import SlurmCluster, unavailable
from tests.slurm.runs import start_training_locally, trained_locally


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


class LocalRuns:
    """``local_run(nproc)``: the final state of the run on ``nproc`` processes of this
    machine, the reference each scheduler's run must equal bit for bit (trained once).
    ``local_run.start(nproc)`` starts it in the background first, so that it trains beside
    the scheduler's job."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._started: dict[int, tuple] = {}
        self._done: dict[int, dict] = {}

    def start(self, nproc: int) -> None:
        if nproc not in self._started:
            directory = self._tmp.mktemp(f"local{nproc}")
            self._started[nproc] = (directory, start_training_locally(directory, nproc))

    def __call__(self, nproc: int) -> dict:
        if nproc not in self._done:
            self.start(nproc)
            self._done[nproc] = trained_locally(*self._started[nproc])
        return self._done[nproc]

    def stop(self) -> None:
        for _, run in self._started.values():
            if run.poll() is None:
                run.kill()
                run.wait()


@pytest.fixture(scope="session")
def local_run(tmp_path_factory):
    runs = LocalRuns(tmp_path_factory)
    yield runs
    runs.stop()
