"""How soon a job starts, and how soon one that fails at once ends: `shoal run` against
torchrun on the same scripts, side by side in one run (this machine is shared and noisy).

For each launcher and --nproc-per-node 1 and 2, --runs runs each, alternated:
- first line: from the launcher's start to the first line of a script that prints the time
  before it imports anything (the rank that gets there last);
- torch imported: the same for a script whose first line is `import torch`;
- fails at once: the whole command, for a script whose first line raises.
Prints the medians and shoal's ratio to torchrun (at most 1.0 is the target). Each launcher
runs once first, unmeasured, and Python may write its bytecode caches (as on a user's
machine: PYTHONDONTWRITEBYTECODE, where set, would make shoal compile its source at every
start, while torch's caches come with its wheel).

    python benchmarks/startup.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# One write each: torchrun's ranks share its stdout, where two prints could mix.
FIRST = "import time, os\nos.write(1, f\"first {os.environ['RANK']} {time.time()}\\n\".encode())\n"
TORCH = "import torch\n" + FIRST
FAILS = "raise ValueError('at once')\n"

BIN = Path(sys.executable).parent
LAUNCHERS = {
    "torchrun": [str(BIN / "torchrun")],
    "shoal run": [sys.executable, "-m", "shoal", "run"],
    "shoal run --no-preload": [sys.executable, "-m", "shoal", "run", "--no-preload"],
}


def _once(launcher: list[str], nproc: int, script: Path) -> tuple[float, float]:
    """(seconds to the last rank's first line, seconds of the whole command)."""
    start = time.time()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run([*launcher, "--nproc-per-node", str(nproc), str(script)],
                         capture_output=True, text=True, timeout=300,
                         env={**env, "OMP_NUM_THREADS": "1"})
    total = time.time() - start
    firsts = [float(found) for found in re.findall(r"first \d+ (\d+\.\d+)", out.stdout)]
    return (max(firsts) - start if firsts else float("nan")), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="shoal-startup-"))
    scripts = {"first line": FIRST, "torch imported": TORCH, "fails at once": FAILS}
    for name, text in scripts.items():
        (folder / f"{name.replace(' ', '_')}.py").write_text(text)
    results: dict[tuple[str, int, str], list[float]] = {}
    for command in LAUNCHERS.values():  # warm-up: caches written, nothing measured
        _once(command, 1, folder / "first_line.py")
    for _ in range(args.runs):
        for nproc in (1, 2):
            for launcher, command in LAUNCHERS.items():
                for name in scripts:
                    first, total = _once(command, nproc, folder / f"{name.replace(' ', '_')}.py")
                    value = total if name == "fails at once" else first
                    results.setdefault((launcher, nproc, name), []).append(value)
    print(f"medians of {args.runs} runs, seconds (ratio to torchrun)")
    print(f"{'launcher':<24} {'nproc':>5} " + " ".join(f"{n:>22}" for n in scripts))
    for nproc in (1, 2):
        for launcher in LAUNCHERS:
            cells = []
            for name in scripts:
                median = statistics.median(results[(launcher, nproc, name)])
                base = statistics.median(results[("torchrun", nproc, name)])
                cells.append(f"{median:>12.2f} ({median / base:4.2f}x)")
            print(f"{launcher:<24} {nproc:>5} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
