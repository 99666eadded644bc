"""The PPO learner: every rank collects from its own environments, all learn one policy.

Each update, every rank steps its num_envs environments num_steps times, then makes
update_epochs passes over its samples in num_minibatches minibatches; DDP averages the
gradients of each minibatch over the ranks, so one optimizer step sees the union of all
ranks' minibatches, and the policy stays the same on every rank (rank 0's initial weights
are broadcast when DDP wraps the policy, and again after a checkpoint is loaded).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import cast

import numpy as np
import torch

from shoal.checkpoint import CheckpointStore, rng
from shoal.errors import UsageError
from shoal.metrics.recorder import StepMetrics
from shoal.parallel.fsdp import broadcast_from_first
from shoal.parallel.traffic import StepComm
from shoal.rl.config import PPOConfig
from shoal.rl.envs import capture_envs, check_env, derive_seed, make_envs, restore_envs
from shoal.rl.evaluate import evaluate
from shoal.rl.policy import ActorCritic
from shoal.rl.rollout import Batch, Episodes, collect
from shoal.runtime.heartbeat import heartbeat
from shoal.runtime.seeds import seed_everything
from shoal.training.harness import Harness
from shoal.training.preemption import PreemptionWatch, exit_code
from shoal.training.state import load_model_and_optimizer_state, model_and_optimizer_state

LABELS = {"data": "rollout", "compute": "learn"}
EXTRAS = ("episode_return", "episode_length", "episodes", "env_steps")


def minibatch_order(n: int, num_minibatches: int, epochs: int,
                    generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """The sample indices of each minibatch of an update: a new shuffle every epoch."""
    return [part for _ in range(epochs)
            for part in torch.randperm(n, generator=generator).chunk(num_minibatches)]


class PPO:
    """Build with a validated ``PPOConfig`` inside a launched job (or alone); ``train()``."""

    def __init__(self, config: PPOConfig):
        c = self.config = config
        self.harness = h = Harness("ddp", backend=c.backend, seed=c.seed)
        self.rank, self.world = h.rank, h.world_size
        self.device = h.device
        self.info = check_env(c.env)
        # Each rank draws its own initial weights; DDP gives every rank rank 0's, so the
        # replicas are equal by construction, not by equal seeds.
        seed_everything(derive_seed(c.seed, self.rank))
        self.policy = ActorCritic(self.info, c.hidden)
        optimizer = torch.optim.Adam(self.policy.parameters(), lr=c.learning_rate, eps=1e-5)
        if self.world > 1:
            # ddp: a module (no PipelineModel), and the optimizer given
            self.model, self.optimizer = cast("tuple[torch.nn.Module, torch.optim.Optimizer]",
                                              h.setup(self.policy, optimizer))
        else:  # one process: nothing to average, no DDP to pay for
            self.model, self.optimizer = self.policy.to(self.device), optimizer
        self.update = self.env_steps = 0
        self._open_envs(c.num_envs, generation=0)
        self.store = CheckpointStore(c.checkpoint_dir, keep_last=c.keep_last) \
            if c.checkpoint_dir else None
        self.saved_update = -1
        self.eval_return: float | None = None
        # The MLflow run's id, kept in checkpoints: a resumed run logs into the same run.
        self.tracking: dict[str, str] = {}

    def _open_envs(self, num_envs: int, generation: int) -> None:
        """This rank's environments, seeded from (seed, rank, index, generation)."""
        c = self.config
        self.num_envs = num_envs
        self.global_batch = num_envs * c.num_steps * self.world
        self.num_updates = c.total_steps // self.global_batch
        seeds = [derive_seed(c.seed, self.rank, i, generation) for i in range(num_envs)]
        self.envs, self.obs = make_envs(c.env, num_envs, seeds)
        self.episodes = Episodes(num_envs)

    def _say(self, message: str) -> None:
        if self.rank == 0:
            print(f"shoal rl: {message}", file=sys.stderr, flush=True)

    # -- learning ---------------------------------------------------------------------------

    def learn(self, batch: Batch, order: list[torch.Tensor], clock=None
              ) -> tuple[torch.Tensor, StepComm]:
        """PPO's clipped objective, one optimizer step per minibatch of ``order``; returns
        the last minibatch's loss and the update's communication."""
        c, h = self.config, self.harness
        adv = batch["advantages"]
        if c.norm_adv:  # over the global batch: the same statistics on every rank
            stats = torch.stack([adv.double().sum(), adv.double().square().sum(),
                                 torch.tensor(float(adv.numel()), dtype=torch.float64,
                                              device=adv.device)])
            if self.world > 1:
                torch.distributed.all_reduce(stats)
            total, squares, count = stats.tolist()
            mean = total / count
            std = max((squares - count * mean * mean) / max(count - 1, 1), 0.0) ** 0.5
            adv = (adv - mean) / (std + 1e-8)
        sent = waited = blocked = 0.0
        loss = torch.zeros((), device=self.device)
        for index in order:
            micro = index.chunk(c.accumulate)
            for j, part in enumerate(micro):
                with h.no_sync(self.model, enabled=j < len(micro) - 1):
                    logp, entropy, value = self.model(batch["obs"][part], batch["actions"][part])
                    ratio = (logp - batch["logprobs"][part]).exp()
                    a = adv[part]
                    policy_loss = torch.max(-a * ratio,
                                            -a * ratio.clamp(1 - c.clip_coef, 1 + c.clip_coef))
                    value_loss = 0.5 * (value - batch["returns"][part]).square().mean()
                    loss = (policy_loss.mean() - c.ent_coef * entropy.mean()
                            + c.vf_coef * value_loss)
                    h.backward(loss / len(micro))
                if clock:
                    clock.lap("forward_backward")
            h.step(self.optimizer, model=self.model, clip_grad_norm=c.max_grad_norm)
            if clock:
                clock.lap("optimizer")
            sent += h.last_comm.bytes
            waited += h.last_comm.wait
            blocked += h.last_comm.blocked
        return loss.detach(), StepComm(sent, waited, blocked)

    def _episodes(self) -> tuple[float, float, float]:
        """(episodes finished in this update by all ranks, their mean return, mean length)."""
        count, returns, lengths = self.episodes.take()
        if self.world > 1:
            sums = torch.tensor([count, returns, lengths], dtype=torch.float64,
                                device=self.device)
            torch.distributed.all_reduce(sums)
            count, returns, lengths = sums.tolist()
        nan = float("nan")
        return count, returns / count if count else nan, lengths / count if count else nan

    # -- the run ----------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        """Train until total_steps (or target_return); returns the run's figures."""
        c, h = self.config, self.harness
        if c.resume:
            self.resume(c.resume)
        self._say(f"PPO on {c.env}: {self.world} processes x {self.num_envs} environments x "
                  f"{c.num_steps} steps = a global batch of {self.global_batch:,} environment "
                  f"steps per update; {self.num_updates} updates "
                  f"({self.num_updates * self.global_batch:,} steps)"
                  + (f", from update {self.update}" if self.update else ""))
        metrics = StepMetrics(c.metrics, self.device, self.rank, self.world, extras=EXTRAS,
                              labels=LABELS, start_step=self.update,
                              resumed=self.update > 0,
                              params={"rl": c.model_dump(mode="json")},
                              tracking=self.tracking) if c.metrics.enabled else None
        clock = metrics.clock if metrics else None
        watch = PreemptionWatch(self.device) if self.store else None
        start, start_steps = time.perf_counter(), self.env_steps
        window = [0.0, 0.0, 0.0]  # episodes, return sum, length sum since the last log line
        last = {"return": float("nan"), "length": float("nan")}
        try:
            if watch:
                watch.start()
            if clock:
                clock.begin()
            stop = False
            while self.update < self.num_updates and not stop:
                lr = c.learning_rate * (1 - self.update / self.num_updates) if c.anneal_lr \
                    else c.learning_rate
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                batch, self.obs = collect(self.policy, self.envs, self.info, self.obs,
                                          c.num_steps, c.gamma, c.gae_lambda, self.episodes,
                                          self.device)
                if clock:
                    clock.lap("data")
                order = minibatch_order(batch["advantages"].numel(), c.num_minibatches,
                                        c.update_epochs)
                loss, comm = self.learn(batch, order, clock)
                self.update += 1
                self.env_steps += self.global_batch
                count, mean_return, mean_length = self._episodes()
                if count:
                    window = [window[0] + count, window[1] + mean_return * count,
                              window[2] + mean_length * count]
                if metrics:
                    metrics.step(self.update, 0, lr, loss, h.last_grad_norm,
                                 self.num_envs * c.num_steps, 0, comm,
                                 {"episode_return": mean_return, "episode_length": mean_length,
                                  "episodes": count, "env_steps": self.env_steps})
                heartbeat(self.update)
                if self.update % c.log_every == 0 or self.update == self.num_updates:
                    if window[0]:
                        last = {"return": window[1] / window[0], "length": window[2] / window[0]}
                    self._progress(last, start, start_steps)
                    window = [0.0, 0.0, 0.0]
                if c.eval_every and self.update % c.eval_every == 0:
                    stop = self._evaluate_and_agree()
                    if metrics:
                        metrics.record("validation", self.update, eval_return=self.eval_return)
                if clock:
                    clock.skip()
                if self.store:
                    if c.checkpoint_every and self.update % c.checkpoint_every == 0:
                        if metrics:  # what the checkpoint holds is logged before it is
                            metrics.sync()
                        self.save()
                    assert watch is not None  # there is one whenever there is a store
                    signum, _ = watch.poll()
                    if signum:
                        self._stop_for(signum, metrics)
            if metrics:
                metrics.finish(show_summary=c.progress)
                metrics.record("event", self.update, kind="end")
        finally:
            if watch:
                watch.stop()
            if metrics:
                metrics.close()
        wall = time.perf_counter() - start  # training (with its evaluations), not the end
        steps = self.env_steps - start_steps
        if self.store and self.saved_update != self.update:
            self.save()
        if self.eval_return is None or not c.eval_every or self.update % c.eval_every:
            self._evaluate_and_agree()
        assert self.eval_return is not None  # just evaluated, if it was not
        result = {"updates": self.update, "env_steps": self.env_steps,
                  "episode_return": last["return"], "episode_length": last["length"],
                  "eval_return": self.eval_return, "wall_s": wall,
                  "env_steps_per_s": steps / wall if wall else float("nan")}
        self._say(f"{steps:,} environment steps in {wall:.1f} s ({result['env_steps_per_s']:,.0f}"
                  f" steps/s over {self.world} processes); deterministic evaluation return "
                  f"{self.eval_return:.1f} over {c.eval_episodes} episodes")
        self.envs.close()
        return result

    def _progress(self, last: dict[str, float], start: float, start_steps: int) -> None:
        if not self.config.progress:
            return
        rate = (self.env_steps - start_steps) / max(time.perf_counter() - start, 1e-9)
        self._say(f"update {self.update}/{self.num_updates}  steps {self.env_steps:,}  "
                  f"return {last['return']:.1f}  length {last['length']:.1f}  "
                  f"{rate:,.0f} steps/s")

    def _evaluate_and_agree(self) -> bool:
        """Rank 0 evaluates; every rank learns whether the target return is reached."""
        c = self.config
        flag = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.rank == 0:
            mean, std = evaluate(self.policy, c.env, self.info, c.eval_episodes, c.seed,
                                 self.device)
            flag[0] = mean
            flag[1] = float(c.target_return is not None and mean >= c.target_return)
            if c.progress:
                self._say(f"evaluation at update {self.update}: return {mean:.1f} +- "
                          f"{std:.1f} over {c.eval_episodes} episodes")
        if self.world > 1:
            torch.distributed.broadcast(flag, src=0)
        self.eval_return = flag[0].item()
        return bool(flag[1].item())

    def _stop_for(self, signum: int, metrics: StepMetrics | None) -> None:
        if self.saved_update != self.update:
            self.save()
        if metrics:
            metrics.finish(show_summary=False)
        assert self.store is not None  # a preemption stops only a run that checkpoints
        self._say(f"preempted by {signal.Signals(signum).name} at update {self.update}: "
                  f"checkpoint saved in {self.store.root}; exiting with code "
                  f"{exit_code(signum)}")
        raise SystemExit(exit_code(signum))

    # -- checkpoints ------------------------------------------------------------------------

    def save(self) -> Path:
        """A checkpoint at this update boundary: policy, optimizer, counters, and each
        rank's random streams, environments and episodes in progress (collective)."""
        c = self.config
        model_state, optimizer_state = model_and_optimizer_state(self.policy, self.optimizer)
        own = {"rng": rng.capture(), "envs": capture_envs(self.envs),
               "obs": torch.from_numpy(np.array(self.obs, copy=True)),
               "episodes": self.episodes.state_dict()}
        meta = {"update": self.update, "env_steps": self.env_steps, "env": c.env,
                "num_envs": self.num_envs, "global_envs": self.num_envs * self.world,
                "num_steps": c.num_steps, "seed": c.seed, "rl_config": c.model_dump(mode="json"),
                "tracking": self.tracking}
        assert self.store is not None  # saved only with a checkpoint_dir
        path = self.store.save(self.update, {"model": model_state,
                                             "optimizer": optimizer_state}, own, meta)
        self.saved_update = self.update
        return path

    def resume(self, source: str) -> None:
        """Continue from a checkpoint ('auto': the newest in checkpoint_dir). At the world
        size and environment count that saved it, exactly; at another world size, with the
        same global batch, and said what starts afresh."""
        store = self.store or CheckpointStore(Path(source).parent)
        path = store.latest() if source == "auto" else Path(source)
        if path is None:
            self._say(f"no checkpoint in {store.root}; starting from the beginning")
            return
        shared, own, meta = store.load(path)
        if meta.get("env") != self.config.env:
            raise UsageError(f"checkpoint {path} was trained on {meta.get('env')!r}, not "
                             f"{self.config.env!r}")
        load_model_and_optimizer_state(self.policy, self.optimizer, shared["model"],
                                       shared["optimizer"])
        broadcast_from_first(self.policy)  # the same policy everywhere, whatever was read
        self.update, self.env_steps = meta["update"], meta["env_steps"]
        self.saved_update = self.update
        self.tracking = dict(meta.get("tracking") or {})  # the MLflow run to continue
        if own is not None and meta["world_size"] == self.world \
                and meta["num_envs"] == self.num_envs:
            rng.restore(own["rng"])
            restore_envs(self.envs, own["envs"])
            self.obs = own["obs"].numpy().copy()
            self.episodes.load_state_dict(own["episodes"])
            kept = "exactly"
        else:
            self._change_layout(path, meta)
            kept = "with the same global batch"
        writes = (f"new checkpoints go to {self.store.root}" if self.store
                  else "no new checkpoints are written (checkpoint_dir is unset)")
        self._say(f"resumed from {path} (update {self.update}, {self.env_steps:,} steps, "
                  f"saved by {meta['world_size']} processes) {kept}; {writes}")

    def _change_layout(self, path: Path, meta: dict) -> None:
        """Another world size: keep the global number of environments, start afresh what
        belonged to the old ranks."""
        total = meta["global_envs"]
        if total % self.world:
            raise UsageError(f"checkpoint {path} stepped {total} environments in all; "
                             f"{self.world} processes cannot share them equally: resume with "
                             f"a number of processes that divides {total}")
        self.envs.close()
        self._open_envs(total // self.world, generation=self.update)
        seed_everything(derive_seed(self.config.seed, self.rank, self.update))
        self._say(f"{self.world} processes x {self.num_envs} environments keep the "
                  f"checkpoint's {total} environments (saved by {meta['world_size']} "
                  f"processes); the episodes in progress and each rank's random streams "
                  "cannot carry over to another layout and start afresh")
