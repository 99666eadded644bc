"""A process group that a worker's script destroys is held until the worker ends, and let
go from Python: never freed by a DDP model's reducer, whose destructor keeps the GIL while
gloo's threads may need it (a forked worker hung now and then after a torchrun script)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""\
    import os, sys
    from shoal.runtime import held_groups
    if sys.argv[1] == "imported":  # a forked worker: torch is imported before the script
        import torch
    held_groups.hold_destroyed_groups()
    import torch, torch.distributed as dist
    from torch.distributed import destroy_process_group  # as a script may take it
    from shoal.launch.worker import _shut_down

    def threads():
        return len(os.listdir("/proc/self/task"))

    def main():  # a torchrun script: the model is a local of main, freed as it returns
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        model(torch.ones(2, 4)).sum().backward()
        other = dist.new_group([0])
        destroy_process_group(other)  # a group of its own first, then every group
        destroy_process_group()
        return [model.process_group, other]

    counts = []
    for epoch in range(6):  # set up and destroyed once an epoch: one generation is held
        groups = main()
        held = held_groups.held()
        assert len(held) == 2 and all(any(g is h for h in held) for g in groups), held
        counts.append(threads())
    del groups, held
    _shut_down({})
    # gloo's threads of the groups let go end (not as many more each epoch)
    assert held_groups.held() == [] and counts[-1] == counts[1] > threads(), (
        counts, threads())
    print("ended")
""")


@pytest.mark.parametrize("torch_first", ["imported", "not imported"])
def test_the_groups_a_script_destroys_are_held_until_the_worker_ends(torch_first):
    out = subprocess.run([sys.executable, "-c", SCRIPT, torch_first], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ended", out.stderr[-3000:]
