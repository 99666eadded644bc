"""How a worker ends after the user's script: the script's objects are freed while the
interpreter is whole, and a DDP model's process group is let go from Python, last."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""\
    import torch, torch.distributed as dist
    from shoal.launch.worker import _ddp_process_groups, _shut_down
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    model(torch.ones(2, 4)).sum().backward()
    dist.destroy_process_group()  # as a torchrun script ends: the model holds the group
    found = _ddp_process_groups()
    assert found == [model.process_group], found
    namespace = {"model": model}
    del model, found
    _shut_down(namespace)
    assert namespace == {} and _ddp_process_groups() == []
    print("ended")
""")


def test_a_ddp_models_group_is_found_and_let_go_after_the_model():
    """A torchrun script destroys its process group while its DDP model lives on: the model's
    reducer then holds the group, and freed by it (with the GIL held) the group waited for
    gloo's threads, which may need the GIL: a forked worker hung now and then after the
    script's last line. The worker finds each DDP model's group before it frees the
    script's objects, and lets it go from Python after them."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ended", out.stderr[-3000:]
