"""Worker entry of an ``rl:`` run config (`shoal train` and `shoal rl`).

Run by the launcher as ``python -m shoal.launch.rl_entry --config RUN_DIR/config.yaml`` (node 0),
or ``--config RUN.yaml key.sub=value ...`` (the other nodes).
"""

from __future__ import annotations

import json
from pathlib import Path

from shoal.config.schema import RLRunConfig
from shoal.launch.train_entry import worker_main


def train_from_config(config: RLRunConfig) -> dict[str, float]:
    """Train PPO as ``config.rl`` says; rank 0 writes metrics.json in the run directory."""
    from shoal.rl.ppo import PPO
    from shoal.runtime import dist as rt

    rt.init(config.rl.backend)
    result = PPO(config.rl).train()
    if rt.is_main():
        assert config.run.dir is not None  # the loader sets it
        Path(config.run.dir).mkdir(parents=True, exist_ok=True)
        (Path(config.run.dir) / "metrics.json").write_text(json.dumps(result, indent=2))
        print(f"done: return {result['episode_return']:.1f}, evaluation "
              f"{result['eval_return']:.1f}, {result['env_steps']:,} steps\n"
              f"run directory: {config.run.dir}", flush=True)
    return result


def main() -> None:
    worker_main("shoal.launch.rl_entry", train_from_config)


if __name__ == "__main__":
    main()
