"""What `shoal doctor` found, as data and as text: node reports, check results, the verdict.

Pure functions only (no sockets, no store), so that the comparison of versions and the
wording of the verdict can be tested without starting anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

CHECKS = ("local", "port", "reach", "rendezvous", "versions", "bandwidth")
"""Every check, in the order they run and are printed."""
VERSION_KEYS = ("python", "torch", "cuda", "nccl")


@dataclass
class Result:
    """One check's outcome on one node."""

    check: str
    """One of ``CHECKS``."""
    rank: int
    """The node the result is about."""
    status: str
    """PASS, FAIL or SKIP."""
    detail: str
    """What was seen; for a failure, the reason."""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


@dataclass
class NodeReport:
    """The local facts of one node, as it writes them to the master's store."""

    rank: int
    """The node's ``--node-rank``."""
    nnodes: int
    """The node's ``--nnodes``, which must be node 0's."""
    hostname: str
    interface: str | None
    """The interface whose route reaches the master (None when there is no route)."""
    address: str | None
    """This node's address on that interface."""
    versions: dict[str, str | None]
    """``VERSION_KEYS`` to version strings (None: not installed, e.g. CUDA on a CPU build)."""
    gpus: list[str] = field(default_factory=list)
    """Names of the visible CUDA devices."""
    results: list[Result] = field(default_factory=list)
    """The checks this node ran by itself (local, then port or reach)."""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> NodeReport:
        results = [Result(**r) for r in data.get("results", [])]
        return cls(**{**data, "results": results})


def who(rank: int, report: NodeReport | None, address: bool = True) -> str:
    """'node 1 (host1, 10.0.0.2)', or 'node 1' for a node that never reported."""
    if report is None:
        return f"node {rank}"
    if address and report.address:
        return f"node {rank} ({report.hostname}, {report.address})"
    return f"node {rank} ({report.hostname})"


def compare_versions(reports: dict[int, NodeReport]) -> list[Result]:
    """One FAIL per node whose versions differ from node 0's, or one PASS for all."""
    reference = reports.get(0)
    if reference is None:
        return []
    failures = []
    for rank, report in sorted(reports.items()):
        differ = [key for key in VERSION_KEYS
                  if report.versions.get(key) != reference.versions.get(key)]
        if differ:
            theirs = ", ".join(f"{key} {report.versions.get(key) or 'none'}" for key in differ)
            ours = ", ".join(f"{key} {reference.versions.get(key) or 'none'}" for key in differ)
            failures.append(Result("versions", rank, "FAIL", f"{theirs} (node 0: {ours})"))
    if failures:
        return failures
    same = ", ".join(f"{key} {reference.versions.get(key) or 'none'}" for key in VERSION_KEYS)
    if len(reports) == 1:
        return [Result("versions", 0, "PASS", f"{same} (one node: nothing to compare)")]
    return [Result("versions", 0, "PASS", f"the same on all {len(reports)} nodes: {same}")]


def _fmt(value: str | None) -> str:
    return value if value else "-"


def table(nnodes: int, reports: dict[int, NodeReport]) -> list[str]:
    """One row per node; a node that never reported keeps its row, marked as such."""
    header = ["rank", "hostname", "interface", "address", *VERSION_KEYS, "gpus"]
    rows = [header]
    for rank in range(nnodes):
        report = reports.get(rank)
        if report is None:
            rows.append([str(rank), "(not reported)"])
            continue
        rows.append([str(rank), report.hostname, _fmt(report.interface), _fmt(report.address),
                     *(_fmt(report.versions.get(key)) for key in VERSION_KEYS),
                     str(len(report.gpus))])
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(header))]
    # A node that never reported has a short row: zip stops at its last cell.
    return ["  ".join(cell.ljust(width)
                      for cell, width in zip(row, widths, strict=False)).rstrip()
            for row in rows]


def check_lines(results: list[Result], reports: dict[int, NodeReport]) -> list[str]:
    """One line per check that passed everywhere; one line per node where a check failed."""
    lines = []
    for check in CHECKS:
        mine = [r for r in results if r.check == check]
        failed = [r for r in mine if r.failed]
        if failed:
            lines += [f"{check:<11} FAIL  {who(r.rank, reports.get(r.rank))}: {r.detail}"
                      for r in failed]
        elif len(mine) == 1:
            lines.append(f"{check:<11} {mine[0].status}  {mine[0].detail}")
        elif mine:  # the details are in each node's own output and in the table
            lines.append(f"{check:<11} PASS  on {len(mine)} nodes")
    return lines


def verdict_lines(nnodes: int, results: list[Result],
                  reports: dict[int, NodeReport]) -> list[str]:
    """The last lines: 'shoal doctor: PASS (N nodes)', or one FAIL line per failure."""
    failed = [r for r in results if r.failed]
    if not failed:
        return [f"shoal doctor: PASS ({nnodes} node{'s' if nnodes > 1 else ''})"]
    failed.sort(key=lambda r: (r.rank, CHECKS.index(r.check)))
    return [f"shoal doctor: FAIL: {who(r.rank, reports.get(r.rank), address=False)}: "
            f"{r.check}: {r.detail}" for r in failed]


def render(nnodes: int, master: str, results: list[Result],
           reports: dict[int, NodeReport]) -> tuple[str, int]:
    """Node 0's whole report and the exit code every node returns (0 pass, 1 fail)."""
    lines = [f"shoal doctor: {nnodes} node{'s' if nnodes > 1 else ''}, master {master}",
             *table(nnodes, reports), *check_lines(results, reports),
             *verdict_lines(nnodes, results, reports)]
    return "\n".join(lines), int(any(r.failed for r in results))
