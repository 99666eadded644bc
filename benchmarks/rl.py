"""Distributed PPO on CartPole-v1: time to a solved policy at 1 and 2 processes, and
shoal's learner against a hand-written single-file PPO loop.

1. Time to target: `shoal rl` at 1 and 2 processes (one thread each) with the
   hyperparameters of examples/cartpole.yaml and the same global batch (32 environments in
   all), until a deterministic evaluation of 20 episodes (every 5 updates) reaches a mean
   return of 475, or 150,000 environment steps. Prints, per run: the environment steps it
   took, the training wall time (evaluations included; process start-up not), the wall
   time of the whole command, steps per second, and the 2-process speed-up in steps/s.
   Targets on a 2-core machine: >= 475 within 150 k steps; <= 90 s at 2 processes;
   2 processes >= 1.6x the steps/s of 1.
2. Overhead: shoal's learner at 1 process (step metrics on, no evaluation) against the
   hand-written loop below with the same hyperparameters and the same number of updates,
   each in a fresh process, interleaved, --repeats times; the median ratio of steps/s
   (target: shoal within 5 %).

A measurement, not a test: exits 0.

    python benchmarks/rl.py [--repeats 3] [--skip-target] [--skip-overhead]
"""

# ruff: noqa: E402
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HYPER = {"num_steps": 64, "learning_rate": 1e-3, "update_epochs": 10, "num_minibatches": 4,
         "gamma": 0.98, "gae_lambda": 0.8, "clip_coef": 0.2, "ent_coef": 0.0, "vf_coef": 0.5,
         "max_grad_norm": 0.5, "hidden": 64}
GLOBAL_ENVS = 32


def shoal_run(world: int, extra: list[str]) -> dict:
    """`shoal rl` in a fresh process; its metrics.json and the command's wall time."""
    with tempfile.TemporaryDirectory() as run_dir:
        settings = [f"{k}={v}" for k, v in HYPER.items()]
        command = [sys.executable, "-m", "shoal", "rl", "--env", "CartPole-v1",
                   "--nproc-per-node", str(world), f"num_envs={GLOBAL_ENVS // world}",
                   *settings, f"run.dir={run_dir}", "progress=false", *extra]
        start = time.perf_counter()
        out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - start
        if out.returncode:
            raise SystemExit(f"shoal rl failed:\n{out.stderr[-3000:]}")
        return {**json.loads((Path(run_dir) / "metrics.json").read_text()), "command_s": wall}


def handwritten(updates: int, seed: int = 0) -> dict:
    """A single-file PPO loop (the kind one writes by hand): same hyperparameters."""
    import gymnasium as gym
    import torch
    from torch import nn
    from torch.distributions import Categorical

    h = HYPER
    torch.manual_seed(seed)
    n, steps = GLOBAL_ENVS, h["num_steps"]
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1", disable_env_checker=True) for _ in range(n)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs, _ = envs.reset(seed=list(range(n)))

    def mlp(out, gain):
        net = nn.Sequential(nn.Linear(4, h["hidden"]), nn.Tanh(),
                            nn.Linear(h["hidden"], h["hidden"]), nn.Tanh(),
                            nn.Linear(h["hidden"], out))
        for layer, g in zip(net[::2], (2 ** 0.5, 2 ** 0.5, gain), strict=True):
            nn.init.orthogonal_(layer.weight, g)
            nn.init.zeros_(layer.bias)
        return net

    actor, critic = mlp(2, 0.01), mlp(1, 1.0)
    params = [*actor.parameters(), *critic.parameters()]
    optimizer = torch.optim.Adam(params, lr=h["learning_rate"], eps=1e-5)
    b_obs = torch.zeros(steps, n, 4)
    b_act = torch.zeros(steps, n, dtype=torch.long)
    b_logp, b_rew, b_done, b_val = (torch.zeros(steps, n) for _ in range(4))
    start = time.perf_counter()
    for update in range(updates):
        optimizer.param_groups[0]["lr"] = h["learning_rate"] * (1 - update / updates)
        with torch.no_grad():
            for t in range(steps):
                b_obs[t] = torch.as_tensor(obs, dtype=torch.float32)
                dist = Categorical(logits=actor(b_obs[t]))
                action = dist.sample()
                b_act[t], b_logp[t] = action, dist.log_prob(action)
                b_val[t] = critic(b_obs[t]).squeeze(-1)
                obs, reward, term, trunc, _ = envs.step(action.numpy())
                b_rew[t] = torch.as_tensor(reward, dtype=torch.float32)
                b_done[t] = torch.as_tensor(term | trunc, dtype=torch.float32)
            next_value = critic(torch.as_tensor(obs, dtype=torch.float32)).squeeze(-1)
            adv = torch.zeros(steps, n)
            last = torch.zeros(n)
            for t in reversed(range(steps)):
                nv = next_value if t == steps - 1 else b_val[t + 1]
                alive = 1 - b_done[t]
                delta = b_rew[t] + h["gamma"] * nv * alive - b_val[t]
                last = delta + h["gamma"] * h["gae_lambda"] * alive * last
                adv[t] = last
            ret = adv + b_val
        o, a, lp = b_obs.reshape(-1, 4), b_act.reshape(-1), b_logp.reshape(-1)
        adv, ret = adv.reshape(-1), ret.reshape(-1)
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        for _ in range(h["update_epochs"]):
            for idx in torch.randperm(o.shape[0]).chunk(h["num_minibatches"]):
                dist = Categorical(logits=actor(o[idx]))
                ratio = (dist.log_prob(a[idx]) - lp[idx]).exp()
                pg = torch.max(-adv[idx] * ratio, -adv[idx] * ratio.clamp(
                    1 - h["clip_coef"], 1 + h["clip_coef"])).mean()
                v_loss = 0.5 * (critic(o[idx]).squeeze(-1) - ret[idx]).square().mean()
                loss = pg - h["ent_coef"] * dist.entropy().mean() + h["vf_coef"] * v_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(params, h["max_grad_norm"])
                optimizer.step()
    wall = time.perf_counter() - start
    return {"env_steps": updates * n * steps, "env_steps_per_s": updates * n * steps / wall}


def handwritten_run(updates: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--handwritten", str(updates)], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"hand-written loop failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def time_to_target(repeats: int) -> None:
    print("time to a deterministic evaluation return >= 475 (CartPole-v1, 32 environments "
          "in all, batch 2,048 per update)")
    print(f"{'procs':>5} {'steps':>8} {'eval':>6} {'train s':>8} {'command s':>9} "
          f"{'steps/s':>8}")
    rates: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(repeats):
        for world in (1, 2):
            r = shoal_run(world, ["total_steps=150000", "eval_every=5", "target_return=475"])
            rates[world].append(r["env_steps_per_s"])
            print(f"{world:>5} {r['env_steps']:>8,} {r['eval_return']:>6.1f} {r['wall_s']:>8.1f} "
                  f"{r['command_s']:>9.1f} {r['env_steps_per_s']:>8,.0f}", flush=True)
    speedup = statistics.median(rates[2]) / statistics.median(rates[1])
    print(f"2-process speed-up in steps/s: {speedup:.2f}x (target >= 1.6x)\n")


def overhead(repeats: int, updates: int = 20) -> None:
    print(f"shoal's learner (1 process, metrics on) against a hand-written loop: {updates} "
          "updates, same hyperparameters")
    ratios = []
    for i in range(repeats):
        pair = []
        for kind in (("shoal", "hand") if i % 2 == 0 else ("hand", "shoal")):
            if kind == "shoal":
                rate = shoal_run(1, [f"total_steps={updates * GLOBAL_ENVS * HYPER['num_steps']}"]
                                 )["env_steps_per_s"]
            else:
                rate = handwritten_run(updates)["env_steps_per_s"]
            pair.append((kind, rate))
        rate = dict(pair)
        ratios.append(rate["shoal"] / rate["hand"])
        print(f"  shoal {rate['shoal']:,.0f} steps/s, hand-written {rate['hand']:,.0f} steps/s:"
              f" {ratios[-1]:.3f}", flush=True)
    print(f"shoal / hand-written steps/s, median of {repeats}: {statistics.median(ratios):.3f} "
          "(target >= 0.95)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-target", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--handwritten", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.handwritten is not None:
        print(json.dumps(handwritten(args.handwritten)))
        return
    if not args.skip_target:
        time_to_target(args.repeats)
    if not args.skip_overhead:
        overhead(args.repeats)


if __name__ == "__main__":
    main()
