"""A digits job for the live-recovery tests, run by `shoal run --replica-groups R`.

    live_job.py OUT STEPS [--kill GROUP:STEP[:SIGNAL]]... [--pace STEP:SECONDS]

Every worker writes its pid per attempt (OUT/pid.g<group>.a<attempt>.r<rank>) and, at the
end, its model and optimizer state (OUT/final.g<group>.r<rank>.pt). ``--kill G:S`` makes
group G's rank 0 kill itself (SIGKILL) in the forward pass of step S + 1 of its first
attempt, i.e. mid-step, before its gradients reach the other groups. ``--pace K:S``: after
step K group 0 waits until a replacement of group 1 has started, then takes at least S
seconds per step (so that the replacement rejoins before the run ends, under policy
'available').
"""

import argparse
import os
import signal
from pathlib import Path

import torch

import shoal
from shoal.examples.digits import build_data, build_model

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("steps", type=int)
parser.add_argument("--kill", action="append", default=[])
parser.add_argument("--pace", default=None)
parser.add_argument("--metrics", default=None, help="write step metrics to this directory")
args = parser.parse_args()
out = Path(args.out)
shoal.init("gloo")
group = int(os.environ.get("SHOAL_FT_GROUP", "0"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = shoal.rank()
(out / f"pid.g{group}.a{attempt}.r{rank}").write_text(str(os.getpid()))
model = build_model(hidden=64)
trainer = shoal.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch_size=16,
                        progress=False, max_steps=args.steps,
                        metrics={"dir": args.metrics} if args.metrics else {"enabled": False})
for spec in args.kill:
    g, step, *sig = spec.split(":")
    if int(g) == group and attempt == 0 and rank == 0:
        signum = getattr(signal, sig[0]) if sig else signal.SIGKILL

        def kill(*_, step=int(step), signum=signum):
            if trainer.global_step == step:
                os.kill(os.getpid(), signum)
        model.register_forward_pre_hook(kill)
if args.pace and group == 0:
    import time

    after, seconds = args.pace.split(":")

    def pace(*_):
        if trainer.global_step >= int(after):
            while not (out / "pid.g1.a1.r0").exists():
                time.sleep(0.05)
            time.sleep(float(seconds))
    trainer.optimizer.register_step_post_hook(pace)
trainer.fit(build_data()[0])
torch.save({"model": trainer.module.state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "step": trainer.global_step},
           out / f"final.g{group}.r{rank}.pt")
