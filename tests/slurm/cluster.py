"""A real SLURM cluster on test hosts: munged, one slurmctld, one slurmd per host.

    with Hosts(2) as hosts, SlurmCluster(hosts, workdir) as cluster:
        job = cluster.sbatch(script_path, cwd=workdir)
        cluster.wait(job)                        # until it leaves the queue
        cluster.run(["scontrol", "show", "job", job])

Each host (a network namespace from tests/multihost/hosts.py) is a node named after it,
``host0``, ``host1``, ..., at its own address; its slurmd runs inside it, so the tasks it
starts run there too. slurmctld runs on host0, the head node, where the client commands
(sbatch, srun, scontrol) run as well. munged has a pathname socket, which every namespace
reaches. Everything is under ``workdir`` (state, logs) but munged's socket and key and
slurmd's spool, in a short directory of /tmp of their own: munged wants every directory
above its socket open to all (pytest's are not), and slurmstepd's sockets in the spool
must have paths under 108 bytes. The daemons are stopped by pid on exit, the directories removed.

``ip netns exec`` mounts a fresh /sys with no cgroup file system in it: slurmd is told
``CgroupPlugin=cgroup/v1`` instead of probing /sys/fs/cgroup (no cgroup is used: processes
are tracked with proctrack/linuxproc).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.multihost.hosts import Hosts

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
_COMMANDS = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd",
             "sbatch": "slurm-client"}
CTL_PORT, NODE_PORT = 6817, 6818  # each namespace has its own ports: no clash between runs


def unavailable() -> str | None:
    """Why a cluster cannot be made here (a package missing), or None."""
    for command, package in _COMMANDS.items():
        if shutil.which(command) is None and not os.path.exists(f"/usr/sbin/{command}"):
            return (f"{command} is not installed (Debian package {package}: apt-get install "
                    f"{' '.join(PACKAGES)}; the README's test command does it)")
    return None


def _which(command: str) -> str:
    return shutil.which(command) or f"/usr/sbin/{command}"


class SlurmCluster:
    """One node per host of ``hosts``, ``cpus`` CPUs each (more than the machine has: the
    configured counts win, so tasks may share cores)."""

    def __init__(self, hosts: Hosts, workdir: Path, cpus: int = 4):
        self.hosts = hosts
        self.dir = Path(workdir)
        self.cpus = cpus
        self.nodes = [hosts.hostname(i) for i in range(hosts.n)]
        self.conf = self.dir / "slurm.conf"
        self.short = Path(tempfile.mkdtemp(prefix="shoal-slurm-"))
        self._munged: subprocess.Popen | None = None
        self._daemons: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """The environment of every SLURM command (clients and daemons)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_config(self) -> None:
        d = self.dir
        nodes = "".join(f"NodeName={name} NodeAddr={self.hosts.addr(i)} CPUs={self.cpus} "
                        "State=UNKNOWN\n" for i, name in enumerate(self.nodes))
        self.conf.write_text(f"""ClusterName=shoaltest
SlurmctldHost={self.nodes[0]}({self.hosts.addr(0)})
SlurmUser=root
SlurmdUser=root
SlurmctldPort={CTL_PORT}
SlurmdPort={NODE_PORT}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.short}/munge.sock,cred_expire=5
StateSaveLocation={d}/state
SlurmdSpoolDir={self.short}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SchedulerParameters=sched_interval=1,bf_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
KillWait=5
{nodes}PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, timeout: float = 30) -> None:
        d = self.dir
        (d / "state").mkdir(parents=True, exist_ok=True)
        m = self.short
        for name in self.nodes:
            (m / "spool" / name).mkdir(parents=True)
        os.chmod(m, 0o755)  # munged: others may enter, not write
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._write_config()
        self._munged = subprocess.Popen(
            [_which("munged"), "-F", f"--key-file={key}", f"--socket={m}/munge.sock",
             f"--pid-file={m}/munged.pid", f"--log-file={d}/munged.log",
             f"--seed-file={m}/munge.seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self._wait(lambda: (m / "munge.sock").exists(), 10, "munged's socket")
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": self.env}
        self._daemons.append(self.hosts.popen(0, [_which("slurmctld"), "-D", "-i"], **quiet))
        for i, name in enumerate(self.nodes):
            self._daemons.append(self.hosts.popen(i, [_which("slurmd"), "-D", "-N", name],
                                                  **quiet))
        self._wait(self._all_idle, timeout, "every node idle")

    def _all_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%t"], check=False).stdout.split()
        return len(out) == len(self.nodes) and set(out) == {"idle"}

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args for p in [self._munged, *self._daemons] if p and p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"SLURM test cluster: no {what} after {timeout} s (exited: "
                                   f"{dead}); logs:\n{self.logs()}")
            time.sleep(0.1)

    def logs(self, tail: int = 2000) -> str:
        return "\n".join(f"== {path.name}\n{path.read_text(errors='replace')[-tail:]}"
                         for path in sorted(self.dir.glob("*.log")))

    def command(self, argv: list[str], host: int = 0) -> list[str]:
        """``argv`` as run on ``host`` (the head node by default)."""
        return self.hosts.command(host, argv)

    def run(self, argv: list[str], check: bool = True, timeout: float = 60, host: int = 0,
            **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("env", self.env)
        done = self.hosts.run(host, argv, timeout=timeout, capture_output=True, text=True,
                              **kwargs)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr}")
        return done

    def sbatch(self, script: Path, cwd: Path, env: dict[str, str] | None = None) -> str:
        """Submit ``script``; its job id."""
        out = self.run(["sbatch", "--parsable", str(script)], cwd=cwd,
                       env={**self.env, **(env or {})})
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...); {} when gone."""
        out = self.run(["scontrol", "-o", "show", "job", job_id], check=False).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait(self, job_id: str, timeout: float = 120, until=None) -> dict[str, str]:
        """Wait until the job ends (or ``until(job)`` is true); its last state."""
        deadline = time.monotonic() + timeout
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        while True:
            job = self.job(job_id)
            if (until(job) if until else job.get("JobState", "COMPLETED") in ended):
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {job.get('JobState')} after "
                                     f"{timeout} s; logs:\n{self.logs()}")
            time.sleep(0.2)

    def close(self) -> None:
        """Cancel every job, then stop each daemon by pid (KILL after 10 s)."""
        if self._daemons and self._daemons[0].poll() is None:
            self.run(["scancel", "--full", "-u", "root"], check=False, timeout=10)
        for proc in [*self._daemons, self._munged]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*self._daemons, self._munged]:
            if proc is None:
                continue
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._daemons, self._munged = [], None
        shutil.rmtree(self.short, ignore_errors=True)
