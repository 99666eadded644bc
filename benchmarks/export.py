"""Peak memory and speed of `shoal export`: a checkpoint of a model of ``--mb`` MB (float32
Linear layers, the largest ``--largest-mb``), saved as shoal saves it, then exported in a
fresh process to safetensors and to torch; each export's peak resident memory above the
process's after its imports, against the model's size plus its largest tensor (what the
export may hold at most). A measurement, not a test: exits 0.

    python benchmarks/export.py [--mb 600] [--largest-mb 100] [--dir DIR]
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (VmHWM, the process's peak resident memory, starts anew at exec; ru_maxrss does not)
MEASURE = r"""
import sys, time
import torch, safetensors.torch  # (the imports: not the export's)
from shoal.checkpoint.export import export
def peak():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
base = peak()
start = time.perf_counter()
export(sys.argv[1], sys.argv[2], sys.argv[3])
took = time.perf_counter() - start
print(peak() - base, took)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=600)
    parser.add_argument("--largest-mb", type=int, default=100)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    from torch import nn

    from shoal.checkpoint import CheckpointStore

    root = Path(args.dir or tempfile.mkdtemp(prefix="shoal-export-"))
    side = int((args.largest_mb * 2**20 / 4) ** 0.5)  # a square weight of largest_mb
    layers = max(1, round(args.mb / args.largest_mb))
    model = nn.Sequential(*(nn.Linear(side, side) for _ in range(layers)))
    state = model.state_dict()
    size = sum(t.numel() * t.element_size() for t in state.values())
    largest = max(t.numel() * t.element_size() for t in state.values())
    start = time.perf_counter()
    path = CheckpointStore(root / "checkpoints").save(1, {"model": state}, {}, {})
    saved = time.perf_counter() - start
    del model, state
    print(f"model {size / 2**20:.0f} MB in {layers} layers, largest tensor "
          f"{largest / 2**20:.0f} MB; saved in {saved:.1f} s")
    for fmt, name in (("safetensors", "model.safetensors"), ("torch", "model.pt")):
        out = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(root / name), fmt],
                             capture_output=True, text=True, check=True)
        peak, took = map(float, out.stdout.split())
        print(f"export to {fmt:<11}: peak {peak / 2**20:6.0f} MB above the imports "
              f"({peak / (size + largest):.2f} of model + largest tensor), "
              f"{size / 2**20 / took:.0f} MB/s")
    print(f"files in {root}")


if __name__ == "__main__":
    main()
