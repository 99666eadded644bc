"""A worker for the cluster tests: joins the group, all-reduces, writes what it saw.

Usage: python cluster_job.py OUT_DIR; writes OUT_DIR/rank<R>.json.
"""

import json
import os
import sys

import torch

import shoal

shoal.init("gloo")
total = shoal.all_reduce(torch.tensor([float(shoal.rank() + 1)]))
seen = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                             "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                             "MASTER_PORT")}
seen.update(group_rank=shoal.rank(), group_size=shoal.world_size(), sum=total.item(),
            pid=os.getpid())
with open(os.path.join(sys.argv[1], f"rank{shoal.rank()}.json"), "w") as out:
    json.dump(seen, out)
shoal.cleanup()
