"""The source's layout rules that a reader relies on (see docs/architecture.md): no import
circle of any length, and each folder imports only its own floor or the floors below it."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# The floors, lowest first. A top-level folder or module of shoal/ sits on exactly one; "" is
# the package itself (its lazy public names) and sits on top with the command line.
FLOORS = [
    ("base", {"errors", "version", "imports", "extras", "lazy"}),
    ("runtime", {"runtime"}),
    ("building blocks", {"parallel", "checkpoint", "metrics", "data", "models", "ft"}),
    ("training", {"training"}),
    ("features", {"rl", "remote", "dashboard"}),
    ("run config", {"config"}),
    ("launching", {"launch", "clusters", "doctor", "bench", "chaos"}),
    ("entry points", {"cli", "__main__", "examples", ""}),
]

# Imports that run up a floor, each with its reason. The import itself carries a
# "# layers:" comment saying the same, on the line above it.
UPWARD = {
    # The Trainer refuses a layout that would split a RemoteModule's parameters.
    ("shoal.training.trainer", "shoal.remote.module"),
    ("shoal.training.trainer", "shoal.remote.tier"),
    # A checkpoint holds the state of the remote tier a RemoteModule runs on.
    ("shoal.training.checkpointing", "shoal.remote.module"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> dict[str, int]:
    """The shoal modules ``path`` imports, anywhere in it (TYPE_CHECKING blocks and function
    bodies too), each with the line of its first import."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            # "from package import module" runs the package's __init__ first, but that is
            # no use of it: only the module counts then.
            names = submodules or {node.module}
        else:
            continue
        for name in names & modules:
            found[name] = min(found.get(name, node.lineno), node.lineno)
    return found


def _graph() -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {name: _imports(path, set(files)) for name, path in files.items()}
    for name, targets in graph.items():
        targets.pop(name, None)
    return files, graph


def _folder(module: str) -> str:
    """``shoal.launch.spawn`` -> ``launch``; the package itself -> ``""``."""
    return module.split(".")[1] if "." in module else ""


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle in ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done (no circle through it)
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_long_circle_and_no_false_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": {"b"}}) == ["b", "c", "d", "b"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_between_modules():
    _, graph = _graph()
    cycle = find_cycle({name: set(targets) for name, targets in graph.items()})
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_import_circle_between_folders():
    """A circle of folders is a circle of concerns, even when no two files close it."""
    _, graph = _graph()
    folders: dict[str, set[str]] = {}
    for name, targets in graph.items():
        folders.setdefault(_folder(name), set()).update(
            _folder(t) for t in targets if _folder(t) != _folder(name))
    cycle = find_cycle(folders)
    assert cycle is None, "import circle of folders: " + " -> ".join(cycle)


def test_every_folder_has_a_floor():
    placed = [name for _, names in FLOORS for name in names]
    assert len(placed) == len(set(placed)), "a folder on two floors"
    files, _ = _graph()
    unplaced = sorted({_folder(name) for name in files} - set(placed))
    assert not unplaced, f"give {unplaced} a floor in FLOORS (and in docs/architecture.md)"


def test_no_import_runs_up_a_floor():
    floor = {name: level for level, (_, names) in enumerate(FLOORS) for name in names}
    files, graph = _graph()
    upward = sorted((name, target) for name, targets in graph.items() for target in targets
                    if floor[_folder(target)] > floor[_folder(name)])
    unexplained = [f"{a} -> {b} ({FLOORS[floor[_folder(b)]][0]} is above "
                   f"{FLOORS[floor[_folder(a)]][0]})" for a, b in upward if (a, b) not in UPWARD]
    assert not unexplained, "imports up a floor: " + "; ".join(unexplained)
    assert not UPWARD - set(upward), f"UPWARD lists imports that are gone: {UPWARD - set(upward)}"
    for name, target in upward:
        line = graph[name][target]
        above = files[name].read_text().splitlines()[line - 2]
        assert above.lstrip().startswith("# layers:"), \
            f"{files[name]}:{line}: say on the line above why {target} is imported up a floor"


def test_every_top_level_name_resolves():
    import shoal

    for name in shoal.__all__:
        assert getattr(shoal, name) is not None, name
