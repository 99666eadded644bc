"""One PPO update at 2 processes equals one process's update over the union of both
ranks' samples; the replicas start equal because rank 0's weights are broadcast."""

from __future__ import annotations

import torch

import shoal

CONFIG = {"env": "CartPole-v1", "num_envs": 3, "num_steps": 16, "update_epochs": 2,
          "num_minibatches": 4, "accumulate": 2, "hidden": 16, "progress": False,
          "metrics": {"enabled": False}}


def _params(ppo) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ppo.policy.state_dict().items()}


def _update_at_two(config: dict) -> dict:
    from shoal.rl import PPO, PPOConfig
    from shoal.rl.ppo import minibatch_order
    from shoal.rl.rollout import collect

    ppo = PPO(PPOConfig(**config))
    before = _params(ppo)
    c = ppo.config
    batch, _ = collect(ppo.policy, ppo.envs, ppo.info, ppo.obs, c.num_steps, c.gamma,
                       c.gae_lambda, ppo.episodes, ppo.device)
    order = minibatch_order(batch["advantages"].numel(), c.num_minibatches, c.update_epochs,
                            torch.Generator().manual_seed(7 + shoal.rank()))
    ppo.learn(batch, order)
    return {"before": before, "after": _params(ppo), "batch": batch, "order": order}


def _update_at_one(config: dict, before: dict, batches: list, orders: list) -> dict:
    from shoal.rl import PPO, PPOConfig

    ppo = PPO(PPOConfig(**config))
    ppo.policy.load_state_dict(before)
    union = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    n = batches[0]["advantages"].numel()
    order = [torch.cat([parts[0], parts[1] + n]) for parts in zip(*orders, strict=True)]
    ppo.learn(union, order)
    return _params(ppo)


def test_two_process_update_equals_one_process_over_the_union():
    ranks = shoal.spawn(_update_at_two, 2, (CONFIG,))
    # Each rank drew its own initial weights (seeded by rank): equal only by the broadcast.
    for key in ranks[0]["before"]:
        assert torch.equal(ranks[0]["before"][key], ranks[1]["before"][key]), key
        assert torch.equal(ranks[0]["after"][key], ranks[1]["after"][key]), key
    # The ranks stepped different environments.
    assert not torch.equal(ranks[0]["batch"]["obs"], ranks[1]["batch"]["obs"])
    [reference] = shoal.spawn(_update_at_one, 1, (
        CONFIG, ranks[0]["before"], [r["batch"] for r in ranks], [r["order"] for r in ranks]))
    moved = max((reference[k] - ranks[0]["before"][k]).abs().max().item() for k in reference)
    assert moved > 1e-3  # the update did something
    worst = max((ranks[0]["after"][k] - reference[k]).abs().max().item() for k in reference)
    assert worst <= 1e-6, worst


def _short_runs(env_ids: list[str]) -> dict:
    from shoal.rl import PPO, PPOConfig

    results = {}
    for env_id in env_ids:
        ppo = PPO(PPOConfig(env=env_id, num_envs=4, num_steps=32, total_steps=256,
                            update_epochs=2, progress=False, eval_episodes=2,
                            metrics={"enabled": False}))
        results[env_id] = (ppo.train(), ppo.policy.discrete)
    return results


def test_discrete_and_continuous_actions_train():
    [results] = shoal.spawn(_short_runs, 1, (["Acrobot-v1", "Pendulum-v1"],))
    for env_id, discrete in (("Acrobot-v1", True), ("Pendulum-v1", False)):
        result, kind = results[env_id]
        assert kind is discrete
        assert result["env_steps"] == 256 and result["updates"] == 2
        assert result["eval_return"] == result["eval_return"]  # a number, not NaN
