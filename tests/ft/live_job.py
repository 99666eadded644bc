"""A digits job for the live-recovery tests, run by `shoal run --replica-groups R`.

    live_job.py OUT STEPS [--kill GROUP:STEP[:SIGNAL[:RANK]]]... [--pace STEP:SECONDS]
                [--hold STEP] [--late] [--heal-fails G:R] [--checkpoints DIR[:SECONDS]]
                [--metrics DIR[:EVERY]] [--stall G:S:R:SECONDS]
                [--strategy S] [--compression C] [--period H] [--backend gloo|nccl]

Every worker writes its pid per attempt (OUT/pid.g<group>.a<attempt>.r<rank>) and, at the
end, the whole model and optimizer state keyed by name, the same under every strategy
(OUT/final.g<group>.r<rank>.pt). ``--kill G:S`` makes group G's rank 0 (or RANK) kill
itself (SIGKILL) in the forward pass of step S + 1, once (a marker file remembers it),
i.e. mid-step, before its gradients reach the other groups; ``--kill G:S:SIGSTOP`` freezes
it there instead. ``--stall G:S:R:SECONDS``: group G's rank R sleeps SECONDS there instead,
once (a process that stalls: it notices nothing meanwhile).
``--pace K:S``: after step K group 0 waits until a replacement of group 1 has built its
trainer (it is about to train), then takes at least S seconds per step until the
replacement has taken a step (so that it rejoins before the run ends, under policy
'available'; once back, neither of two live groups forms a quorum without the other).
``--hold K``: after step K group 0 writes OUT/held and waits for OUT/go (the test does
something to the job meanwhile); ``--late``: a replacement waits for OUT/go before it builds
its trainer (the other groups wait for it at the quorum); ``--heal-fails G:R``: in a
replacement of group G, rank R's first fetch of a live group's state fails (an error in
torchft's transport), while its other ranks' go through. ``--no-commit G:S``: group G takes
its vote on step S as no, once, while the others commit it. ``--step-sleep S``: after each
step every group writes its step to OUT/step.g<group> and sleeps S seconds (the test acts
on a job under way). ``--observers``: a callback on every hook that only
looks, and a profiler window over steps 2 and 3. ``--kill-after G:S``: group G's rank 0
SIGKILLs itself after step S,
before its checkpoint (once group 0's checkpoint of the step is whole), once.
``--quorum-every S``, ``--share F``: the Trainer's own ``fault_tolerance.quorum_every_s``,
``compression_state_share``. Beside the final state,
OUT/figures.g<group>.r<rank>.json holds the last epoch's train_loss, the validation figures
after the last step, whether its group wrote the checkpoints at the end and how many
quorums the process asked the lighthouse for.
"""

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import shoal
from shoal.examples.digits import build_data, build_model
from shoal.parallel.zero import gather_optimizer_state, is_zero


def full_state(trainer: shoal.Trainer) -> dict:
    """The whole model and optimizer state, keyed by name (collective inside the group)."""
    options = StateDictOptions(full_state_dict=True)
    if is_zero(trainer.optimizer):
        model, _ = get_state_dict(trainer.model, [], options=options)
        return {"model": model,
                "optimizer": gather_optimizer_state(trainer.model, trainer.optimizer)}
    model, optimizer = get_state_dict(trainer.model, trainer.optimizer, options=options)
    return {"model": model, "optimizer": optimizer}


parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("steps", type=int)
parser.add_argument("--kill", action="append", default=[])
parser.add_argument("--observers", action="store_true",
                    help="callbacks on every hook that only look, and a profiler window")
parser.add_argument("--kill-after", default=None,
                    help="G:S: group G's rank 0 SIGKILLs itself after step S, once")
parser.add_argument("--stall", default=None,
                    help="G:S:R:SECONDS: group G's rank R sleeps in the forward of step S + 1")
parser.add_argument("--pace", default=None)
parser.add_argument("--metrics", default=None,
                    help="write step metrics to this directory (a window every EVERY steps)")
parser.add_argument("--checkpoints", default=None,
                    help="checkpoint every step, or every SECONDS (each one kept), resume: auto")
parser.add_argument("--hold", type=int, default=None,
                    help="after this step group 0 writes OUT/held and waits for OUT/go")
parser.add_argument("--step-sleep", type=float, default=None)
parser.add_argument("--heal-fails", default=None,
                    help="G:R: in a replacement of group G, rank R's first heal fails")
parser.add_argument("--late", action="store_true",
                    help="a replacement waits for OUT/go before it builds its trainer")
parser.add_argument("--strategy", default="ddp")
parser.add_argument("--compression", default="none", help="a name, or its settings as JSON")
parser.add_argument("--period", type=int, default=None, help="of local_sgd or diloco")
parser.add_argument("--quorum-every", type=float, default=None,
                    help="the Trainer's fault_tolerance.quorum_every_s")
parser.add_argument("--share", type=float, default=None,
                    help="the Trainer's fault_tolerance.compression_state_share")
parser.add_argument("--backend", default="gloo", help="inside each group (nccl: on the GPU)")
parser.add_argument("--augment", action="store_true",
                    help="noise on each training sample, drawn as it is read (main process)")
parser.add_argument("--no-commit", default=None,
                    help="G:S: group G's vote on step S says no, once (the others commit)")
args = parser.parse_args()
out = Path(args.out)
shoal.init(args.backend)
group = int(os.environ.get("SHOAL_FT_GROUP", "0"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = shoal.rank()
(out / f"pid.g{group}.a{attempt}.r{rank}").write_text(str(os.getpid()))
if args.heal_fails and attempt > 0 and list(map(int, args.heal_fails.split(":"))) == [group,
                                                                                     rank]:
    from torchft.checkpointing.http_transport import HTTPTransport

    fetch = HTTPTransport.recv_checkpoint

    def fails_once(transport, *args, failed=[], **kwargs):  # noqa: B006 - once a process
        if not failed:
            failed.append(True)
            raise ConnectionError("injected: the fetch of a live group's state failed")
        return fetch(transport, *args, **kwargs)
    HTTPTransport.recv_checkpoint = fails_once
if args.late and attempt > 0:
    import time

    while not (out / "go").exists():
        time.sleep(0.05)
model = build_model(hidden=64)
folder, *every = (args.checkpoints or "").split(":")
callbacks = []
if args.kill_after:
    import time

    g, after = map(int, args.kill_after.split(":"))
    marker = out / f"killed-after.{args.kill_after}"

    class KillAfter(shoal.Callback):
        def on_step_end(self, trainer, metrics):
            if group == g and rank == 0 and metrics["step"] == after and not marker.exists():
                # group 0's checkpoint of the step whole first (a restart takes it then)
                written = Path(folder) / f"step_{after:09d}" / "COMMIT.json"
                marker.write_text("")
                deadline = time.monotonic() + 60
                while g != 0 and not written.exists() and time.monotonic() < deadline:
                    shoal.heartbeat(trainer.global_step)
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)
    callbacks.append(KillAfter())
if args.observers:
    from shoal.training.callbacks import HOOKS

    class Looks(shoal.Callback):
        """On every hook, only looks (its count travels in checkpoints and heals)."""

        def __init__(self):
            self.calls = 0

        def state_dict(self):
            return {"calls": self.calls}

        def load_state_dict(self, state):
            self.calls = state["calls"]

    for _hook in HOOKS:
        setattr(Looks, _hook, lambda self, *_: setattr(self, "calls", self.calls + 1))
    callbacks.append(Looks())
trainer = shoal.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch_size=16,
                        progress=False, max_steps=args.steps, strategy=args.strategy,
                        callbacks=callbacks,
                        **({"profile_steps": (2, 3), "profile_dir": str(out / "profile")}
                           if args.observers else {}),
                        compression=json.loads(args.compression)
                        if args.compression.startswith("{") else args.compression,
                        **({args.strategy: {"period": args.period}} if args.period else {}),
                        fault_tolerance={
                            **({"quorum_every_s": args.quorum_every} if args.quorum_every
                               else {}),
                            **({"compression_state_share": args.share} if args.share
                               else {})},
                        metrics=dict(zip(("dir", "every"), args.metrics.split(":"), strict=False))
                        if args.metrics else {"enabled": False},
                        **({"checkpoint_dir": folder, "keep_last": args.steps,
                            "resume": "auto", **({"checkpoint_every_seconds": float(every[0])}
                                                 if every else {"checkpoint_every": 1})}
                           if args.checkpoints else {}))
if args.stall and attempt == 0:
    import time

    g, step, r, seconds = args.stall.split(":")
    if int(g) == group and int(r) == rank:
        def stall(*_, step=int(step), stalled=[]):  # noqa: B006 - once a process
            if trainer.global_step == step and not stalled:
                stalled.append(True)
                time.sleep(float(seconds))
        model.register_forward_pre_hook(stall)
for spec in args.kill:
    g, step, *sig = spec.split(":")
    if int(g) == group and rank == (int(sig[1]) if len(sig) > 1 else 0):
        signum = getattr(signal, sig[0]) if sig else signal.SIGKILL
        marker = out / f"killed.{spec}"

        def kill(*_, step=int(step), signum=signum, marker=marker):
            if trainer.global_step == step and not marker.exists():  # once per --kill
                marker.write_text("")
                os.kill(os.getpid(), signum)
        model.register_forward_pre_hook(kill)
if args.pace and group == 0:
    import time

    after, seconds = args.pace.split(":")

    def pace(*_):
        if trainer.global_step >= int(after) and not (out / "stepped.g1.a1.r0").exists():
            while not (out / "ready.g1.a1.r0").exists():
                shoal.heartbeat(trainer.global_step)  # waiting on purpose: not a hang
                time.sleep(0.05)
            time.sleep(float(seconds))
    trainer.optimizer.register_step_post_hook(pace)
if args.pace and group == 1 and attempt == 1:
    def stepped(*_):  # the replacement's first step is one with group 0: it is back
        (out / f"stepped.g{group}.a{attempt}.r{rank}").write_text("")
    trainer.optimizer.register_step_post_hook(stepped)
if args.hold is not None and group == 0:
    import time

    def hold(*_):
        if trainer.global_step == args.hold and not (out / "go").exists():
            (out / "held").write_text("")
            while not (out / "go").exists():
                time.sleep(0.05)
    trainer.optimizer.register_step_post_hook(hold)
if args.step_sleep is not None:
    import time

    def step_sleep(*_):
        marker = out / f"step.g{group}"  # whole or absent to a reader: written, then renamed
        partial = out / f"step.g{group}.{os.getpid()}.partial"
        partial.write_text(str(trainer.global_step))
        partial.replace(marker)
        time.sleep(args.step_sleep)
    trainer.optimizer.register_step_post_hook(step_sleep)
if args.no_commit:
    from shoal.ft.engine import Replica

    g, step = map(int, args.no_commit.split(":"))
    if group == g:
        vote = Replica.commit

        def commit_but_once(replica, said_no=[]):  # noqa: B006 - once per process
            if replica.step == step - 1 and not said_no:  # S - 1 steps committed so far
                said_no.append(True)
                replica.abstain()
            return vote(replica)
        Replica.commit = commit_but_once



class Augmented(torch.utils.data.Dataset):
    """Each sample with noise from torch's generator, drawn as the sample is read: what a
    random transform in a dataset does."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        x, y = self.data[index]
        return x + 0.1 * torch.randn_like(x), y


(out / f"ready.g{group}.a{attempt}.r{rank}").write_text("")
result = trainer.fit(Augmented(build_data()[0]) if args.augment else build_data()[0])
(out / f"figures.g{group}.r{rank}.json").write_text(json.dumps(
    {"quorums": trainer.live.quorums if trainer.live else None,
     "saves": trainer.live.saves if trainer.live else None,  # it wrote the checkpoints last
     "reports": trainer.reports,  # it wrote the run's final metrics
     "train_loss": result.get("train_loss"),  # none when it healed at the last step
     "validation": trainer.validate(build_data()[1])}))
torch.save({**full_state(trainer), "step": trainer.global_step},
           out / f"final.g{group}.r{rank}.pt")
