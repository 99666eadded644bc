"""`shoal doctor`: check, before a job starts, that the nodes can form one.

The doctor process itself is the participant (rank = node rank, world = nnodes): no elastic
agent and no workers, so it diagnoses a cluster before anything heavier is started. Node 0
hosts a TCPStore on the master address; every other node first checks that the master's
port answers, then writes its local report to the store. Node 0 compares the reports, times
an all-reduce across the nodes and publishes one verdict, which every node prints and exits
with. Every wait has a deadline derived from ``timeout``: the doctor never hangs.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import TCPStore

from shoal.doctor.report import (
    VERSION_KEYS,
    NodeReport,
    Result,
    compare_versions,
    render,
    verdict_lines,
    who,
)
from shoal.errors import UsageError
from shoal.launch.network import resolve, route_to

_PREFIX = "shoal-doctor/"
_GRACE_S = 5.0  # how much longer than node 0 a node waits for node 0's word
_POLL_S = 0.1
_RETRY_S = 0.5  # between connection attempts while the master's port refuses
_WARMUP, _ITERS = 2, 5  # all-reduces in the bandwidth check: untimed, then timed


@dataclass
class DoctorConfig:
    """The topology to check, given as to `shoal run`; validated once, here."""

    nnodes: int = 1
    """Number of nodes; the same on every node."""
    node_rank: int = 0
    """This node's index in ``[0, nnodes)``; node 0 hosts the store."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, as the other nodes reach it."""
    master_port: int | None = None
    """Port of the store on node 0; on one node, None picks a free port."""
    timeout: float = 30.0
    """Seconds that one wait may last (for the master, for the reports, for collectives)."""
    size: int = 64 * 2**20
    """Bytes per all-reduce in the bandwidth check."""

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank must be in [0, {self.nnodes}) for --nnodes "
                             f"{self.nnodes}, got {self.node_rank}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UsageError(f"--master-port must be in 1..65535, got {self.master_port}")
        if self.nnodes > 1 and self.master_port is None:
            raise UsageError("--master-port is required when --nnodes is more than 1")
        if self.timeout <= 0:
            raise UsageError(f"--timeout must be positive, got {self.timeout:g}")
        if self.size < 4:
            raise UsageError(f"--size must be at least 4 bytes, got {self.size}")

    @property
    def master(self) -> str:
        return f"{self.master_addr}:{self.master_port}"


def run_doctor(config: DoctorConfig) -> int:
    """Run every check on this node; print what it finds; 0 when every node passed, else 1."""
    deadline = time.monotonic() + config.timeout
    master = config.master if config.master_port else f"{config.master_addr} (a free port)"
    print(f"shoal doctor: node {config.node_rank} of {config.nnodes}, master {master}, "
          f"timeout {config.timeout:g} s", flush=True)
    report = local_report(config)
    _announce(report, report.results[0])
    if config.node_rank == 0:
        return _run_master(config, report, deadline)
    return _run_node(config, report, deadline)


def local_report(config: DoctorConfig) -> NodeReport:
    """Hostname, route to the master, versions and GPUs of this machine."""
    from shoal.runtime.info import info

    facts = info()
    versions = {key: facts["versions"][key] for key in VERSION_KEYS}
    report = NodeReport(config.node_rank, config.nnodes, facts["hostname"], None, None,
                        versions, facts["cuda_devices"])
    try:
        report.interface, report.address = route_to(config.master_addr)
    except UsageError as exc:
        report.results.append(Result("local", config.node_rank, "FAIL", str(exc)))
        return report
    found = ", ".join(f"{key} {versions[key] or 'none'}" for key in VERSION_KEYS)
    report.results.append(Result(
        "local", config.node_rank, "PASS",
        f"{report.interface or 'unknown interface'} {report.address} routes to the master; "
        f"{found}; {len(report.gpus)} GPU(s)"))
    return report


def _announce(report: NodeReport, result: Result) -> None:
    print(f"{who(report.rank, report)}: {result.check}: {result.status}: {result.detail}",
          flush=True)


def _fail_alone(config: DoctorConfig, report: NodeReport) -> int:
    """This node cannot hear node 0's verdict: print its own failures and fail."""
    print("\n".join(verdict_lines(config.nnodes, report.results, {report.rank: report})),
          flush=True)
    return 1


def _key(name: str, rank: int | None = None) -> str:
    return f"{_PREFIX}{name}" if rank is None else f"{_PREFIX}{name}/{rank}"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]


def _await(store: TCPStore, keys: list[str], deadline: float) -> dict[str, dict]:
    """The JSON value of each key written before the deadline (polled: no blocking wait)."""
    found: dict[str, dict] = {}
    while True:
        for key in keys:
            if key not in found and store.check([key]):
                found[key] = json.loads(store.get(key))
        if len(found) == len(keys) or time.monotonic() >= deadline:
            return found
        time.sleep(_POLL_S)


# -- node 0 ------------------------------------------------------------------------------


def host_store(config: DoctorConfig) -> tuple[TCPStore | None, Result]:
    """Listen on the master address and port and start the store there (the port check)."""
    try:
        family, host = resolve(config.master_addr)
    except UsageError as exc:
        return None, Result("port", 0, "FAIL", str(exc))
    sock = socket.socket(family, socket.SOCK_STREAM)
    # A port in TIME_WAIT is fine for the store; a live listener still fails.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, config.master_port or 0))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        return None, Result("port", 0, "FAIL", _bind_failure(config, exc))
    port = sock.getsockname()[1]
    # The store takes the listening socket: no window in which another process takes the port.
    fd = sock.detach()
    try:
        store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=config.timeout + _GRACE_S),
                         master_listen_fd=fd)
    except RuntimeError as exc:
        os.close(fd)
        return None, Result("port", 0, "FAIL", f"cannot start the store on "
                            f"{config.master_addr}:{port}: {_first_line(exc)}")
    picked = "" if config.master_port else " (picked)"
    return store, Result("port", 0, "PASS",
                         f"port {port}{picked} on {config.master_addr} free; store started")


def _bind_failure(config: DoctorConfig, exc: OSError) -> str:
    where = f"port {config.master_port} on {config.master_addr}"
    if exc.errno == errno.EADDRINUSE:
        return f"{where} is already in use; stop what holds it, or choose another port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"cannot listen on {config.master}: {exc.strerror} ({config.master_addr} is "
                "not an address of this machine: run node 0 on the master)")
    return f"cannot listen on {config.master}: {exc.strerror}"


def _run_master(config: DoctorConfig, report: NodeReport, deadline: float) -> int:
    store, port_result = host_store(config)
    report.results.append(port_result)
    _announce(report, port_result)
    if store is None:
        return _fail_alone(config, report)
    started = time.monotonic()
    store.set(_key("report", 0), json.dumps(report.to_json()))
    found = _await(store, [_key("report", r) for r in range(config.nnodes)], deadline)
    reports = {data["rank"]: NodeReport.from_json(data) for data in found.values()}
    results = [result for r in sorted(reports) for result in reports[r].results]
    rendezvous = _rendezvous_results(config, reports, time.monotonic() - started)
    results += rendezvous + compare_versions(reports)
    results += _bandwidth_results(config, store, reports,
                                  everyone=not any(r.failed for r in rendezvous))
    # Last, so that a second node started with the same rank has had time to show up.
    results += _duplicate_ranks(config, store)
    text, code = render(config.nnodes, f"{config.master_addr}:{store.port}", results, reports)
    store.set(_key("verdict"), json.dumps({"text": text, "code": code}))
    print(text, flush=True)
    _await_readers(store, len(reports) - 1)
    return code


def _rendezvous_results(config: DoctorConfig, reports: dict[int, NodeReport],
                        seconds: float) -> list[Result]:
    results = [Result("rendezvous", r, "FAIL",
                      f"has not reported within {config.timeout:g} s (never reached the "
                      "master: not started, or its network is down)")
               for r in range(config.nnodes) if r not in reports]
    results += [Result("rendezvous", r, "FAIL", f"started with --nnodes {report.nnodes}, "
                       f"node 0 with --nnodes {config.nnodes}")
                for r, report in sorted(reports.items()) if report.nnodes != config.nnodes]
    if results:
        return results
    return [Result("rendezvous", 0, "PASS",
                   f"{config.nnodes} of {config.nnodes} nodes reported in {seconds:.1f} s")]


def _duplicate_ranks(config: DoctorConfig, store: TCPStore) -> list[Result]:
    """Each node counts itself in under its rank: more than one is a copy-paste error."""
    results = []
    for r in range(1, config.nnodes):
        claims = int(store.add(_key("claims", r), 0))
        if claims > 1:
            results.append(Result("rendezvous", r, "FAIL", f"{claims} nodes were started "
                                  f"with --node-rank {r}; each node needs its own"))
    return results


def _bandwidth_results(config: DoctorConfig, store: TCPStore, reports: dict[int, NodeReport],
                       everyone: bool) -> list[Result]:
    """Tell the nodes whether to measure; measure; one PASS, or a FAIL per node that failed.

    Only when ``everyone`` (every node joined as expected): otherwise a collective would
    just wait for the missing node until the timeout."""
    n = config.nnodes
    if n == 1:
        return [Result("bandwidth", 0, "SKIP", "one node: no network to measure")]
    if not everyone:
        store.set(_key("plan"), json.dumps({"backend": None}))
        return [Result("bandwidth", 0, "SKIP", "not every node joined")]
    # NCCL when every node has a GPU of its own (nodes that share a host, as in a test on
    # one machine, would all take GPU 0); gloo on CPU otherwise.
    hostnames = [report.hostname for report in reports.values()]
    own_gpus = all(report.gpus for report in reports.values()) and \
        len(set(hostnames)) == len(hostnames)
    backend = "nccl" if own_gpus else "gloo"
    store.set(_key("plan"), json.dumps({"backend": backend}))
    outcomes: dict[int, dict | None] = {
        0: measure_bandwidth(config, store, backend, reports[0].interface)}
    # Every node runs the same collectives, so the others finish about when node 0 does.
    found = _await(store, [_key("bandwidth", r) for r in range(1, n)],
                   time.monotonic() + _GRACE_S)
    outcomes.update({r: found.get(_key("bandwidth", r)) for r in range(1, n)})
    failures = [Result("bandwidth", r, "FAIL",
                       outcome["error"] if outcome else "no bandwidth result from this node")
                for r, outcome in sorted(outcomes.items()) if not outcome or "error" in outcome]
    if failures:
        return failures
    assert outcomes[0] is not None  # measure_bandwidth's dict
    return [Result("bandwidth", 0, "PASS",
                   _bandwidth_detail(config.size, outcomes[0]["seconds"], n, backend))]


def _bandwidth_detail(nbytes: int, seconds: float, n: int, backend: str) -> str:
    from shoal.bench.allreduce import bandwidths, human

    algbw, busbw = bandwidths(nbytes, seconds, n)
    return (f"all-reduce of {human(nbytes)} over {backend}, {n} nodes: {seconds * 1e3:.1f} ms, "
            f"algbw {algbw / 1e9:.3f} GB/s, busbw {busbw / 1e9:.3f} GB/s")


def _await_readers(store: TCPStore, expected: int) -> None:
    """Keep the store up until the nodes read the verdict (or for a few seconds at most)."""
    deadline = time.monotonic() + _GRACE_S
    while int(store.add(_key("read"), 0)) < expected and time.monotonic() < deadline:
        time.sleep(_POLL_S)


# -- every node ----------------------------------------------------------------------------


def measure_bandwidth(config: DoctorConfig, store: TCPStore, backend: str,
                      interface: str | None) -> dict:
    """{'seconds': per all-reduce of ``config.size`` bytes, slowest node} or {'error': ...}."""
    import torch
    import torch.distributed as dist

    from shoal.bench.allreduce import measure

    if interface is not None:
        # As the launcher does for its workers: gloo and NCCL use the route to the master.
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, interface)
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    try:
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=dist.PrefixStore(_key("pg"), store),
                                rank=config.node_rank, world_size=config.nnodes,
                                timeout=timedelta(seconds=config.timeout))
        return {"seconds": measure(config.size, _ITERS, _WARMUP, device)}
    except RuntimeError as exc:
        return {"error": f"all-reduce over {backend} failed: {_first_line(exc)}"}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# -- nodes other than 0 --------------------------------------------------------------------


def reach_master(config: DoctorConfig, deadline: float) -> Result:
    """Connect to the master's port; again while refused (node 0 may start later)."""
    rank, where = config.node_rank, f"cannot reach the master {config.master}"
    assert config.master_port is not None  # DoctorConfig requires it with --nnodes above 1
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((config.master_addr, config.master_port),
                                          timeout=max(left, 0.1)):
                return Result("reach", rank, "PASS", f"{config.master} answered")
        except ConnectionRefusedError:
            if left <= _RETRY_S:
                return Result("reach", rank, "FAIL", f"{where}: connection refused until the "
                              f"{config.timeout:g} s timeout (nothing listens there: node 0 "
                              "not started, or another --master-port)")
            time.sleep(_RETRY_S)
        except TimeoutError:
            return Result("reach", rank, "FAIL", f"{where}: no answer within "
                          f"{config.timeout:g} s (packets dropped: a firewall, or the wrong "
                          "--master-addr)")
        except OSError as exc:
            return Result("reach", rank, "FAIL", f"{where}: {exc.strerror or exc}")


def _run_node(config: DoctorConfig, report: NodeReport, deadline: float) -> int:
    result = reach_master(config, deadline)
    report.results.append(result)
    _announce(report, result)
    if result.failed:
        return _fail_alone(config, report)
    try:
        return _follow_master(config, report, deadline)
    except RuntimeError as exc:  # torch's store errors: node 0 went away, or is not a store
        result = Result("rendezvous", config.node_rank, "FAIL",
                        f"lost the store on {config.master}: {_first_line(exc)}")
        report.results.append(result)
        return _fail_alone(config, report)


def _follow_master(config: DoctorConfig, report: NodeReport, deadline: float) -> int:
    """Report to node 0, measure when told to, then print node 0's verdict and return its code."""
    rank = config.node_rank
    seconds = max(deadline - time.monotonic(), _GRACE_S)
    store = _connect_store(config, seconds)
    if store is None:
        return _fail_on(config, report, "rendezvous", f"{config.master} accepted the "
                        f"connection, but no store answered within {seconds:.0f} s (another "
                        "program holds the port?)")
    if int(store.add(_key("claims", rank), 1)) > 1:
        return _fail_on(config, report, "rendezvous", f"another node already reported as "
                        f"node {rank}: each node needs its own --node-rank")
    store.set(_key("report", rank), json.dumps(report.to_json()))
    _announce(report, Result("rendezvous", rank, "PASS", f"reported to {config.master}"))
    wait = config.timeout + _GRACE_S  # node 0 waits up to the timeout for the other nodes
    plan = _await(store, [_key("plan")], time.monotonic() + wait).get(_key("plan"))
    if plan is None:
        return _fail_on(config, report, "rendezvous", f"no word from node 0 within {wait:g} s")
    if plan["backend"] is not None:
        outcome = measure_bandwidth(config, store, plan["backend"], report.interface)
        store.set(_key("bandwidth", rank), json.dumps(outcome))
    verdict = _await(store, [_key("verdict")], time.monotonic() + wait).get(_key("verdict"))
    if verdict is None:
        return _fail_on(config, report, "rendezvous", f"no verdict from node 0 within {wait:g} s")
    store.add(_key("read"), 1)
    print(verdict["text"], flush=True)
    return int(verdict["code"])


def _connect_store(config: DoctorConfig, seconds: float) -> TCPStore | None:
    """A client of node 0's store; None when nothing answered like a store within ``seconds``.

    In a thread: torch's client waits for the store's handshake without a deadline, so a
    port held by another program (which accepts, then never answers) would hang it.
    """
    outcome: list[TCPStore | RuntimeError] = []

    def connect() -> None:
        assert config.master_port is not None  # DoctorConfig requires it with --nnodes above 1
        try:
            outcome.append(TCPStore(config.master_addr, config.master_port, is_master=False,
                                    timeout=timedelta(seconds=seconds)))
        except RuntimeError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=connect, name="shoal-doctor-connect", daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        return None
    if isinstance(outcome[0], RuntimeError):
        raise outcome[0]
    return outcome[0]


def _fail_on(config: DoctorConfig, report: NodeReport, check: str, detail: str) -> int:
    result = Result(check, config.node_rank, "FAIL", detail)
    report.results.append(result)
    _announce(report, result)
    return _fail_alone(config, report)
