"""A transformers GPT-2 under shoal's Trainer, a hand-written DDP loop and the transformers
Trainer: step time side by side.

The model is transformers' GPT2LMHeadModel built from a config of about the size of
``shoal.examples.gpt`` (vocab 256, 128 positions, 4 layers of width 128 with 4 heads:
0.84 M parameters, random weights, nothing downloaded), trained on the byte-level standard
library text (``shoal.data.text``, ``causal_lm`` windows of 128 tokens) with AdamW, the
model computing its own loss. Each run is a fresh job of ``--nproc`` processes (gloo on
CPU; ``shoal.spawn``) that trains ``--steps`` optimizer steps of ``--batch-size`` windows
per process; runs are interleaved over ``--repeats`` rounds, the order rotating each round
(this machine is shared and noisy). Per run: the median interval between optimizer steps
(the same optimizer hook everywhere), the slowest rank's. Prints medians over rounds and
each one's step-time ratio to the hand-written loop (shoal's target: within 1.05x, and not
slower than the transformers Trainer), and of the hand-written loop run a second time (an
A/A control: how far from 1 noise alone moves a ratio). shoal runs with its defaults (step
metrics on). A measurement, not a test: exits 0.

    pip install -c constraints.txt -e ".[hf,bench]"   # the transformers Trainer needs accelerate
    python benchmarks/hf.py [--nproc 2] [--repeats 3] [--steps 100] [--batch-size 8]
"""

# ruff: noqa: E402
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 processes on 2 cores: no oversubscription

import argparse
import importlib.util
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import shoal
from shoal.data.text import build_data
from shoal.models.hf import HFModelConfig, build_model

SEED, LR = 0, 1e-3
GPT2 = HFModelConfig(model_class="GPT2LMHeadModel", seed=SEED, config={
    "vocab_size": 256, "n_positions": 128, "n_embd": 128, "n_layer": 4, "n_head": 4,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": False,
    "bos_token_id": 0, "eos_token_id": 0})


def _setup(stamps: list[float]):
    model = build_model(GPT2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    optimizer.register_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    return model, optimizer


def hand_written(data, steps: int, batch: int, stamps: list[float]) -> None:
    dist.init_process_group("gloo")
    model, optimizer = _setup(stamps)
    ddp = DistributedDataParallel(model)
    sampler = DistributedSampler(data, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=batch, sampler=sampler)
    done = epoch = 0
    while done < steps:
        sampler.set_epoch(epoch)
        for batch_ in loader:
            ddp(**batch_).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done >= steps:
                break
        epoch += 1


def shoal_trainer(data, steps: int, batch: int, stamps: list[float]) -> None:
    model, optimizer = _setup(stamps)
    trainer = shoal.Trainer(model, optimizer, batch_size=batch, seed=SEED, progress=False)
    trainer.fit(data, max_steps=steps)


def hf_trainer(data, steps: int, batch: int, stamps: list[float]) -> None:
    import transformers

    model, optimizer = _setup(stamps)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch, max_steps=steps,
            learning_rate=LR, max_grad_norm=0.0, use_cpu=True, ddp_backend="gloo",
            report_to=[], save_strategy="no", logging_strategy="no", seed=SEED,
            disable_tqdm=True, dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       optimizers=(optimizer, None))
        trainer.train()


# "hand again" is the hand-written loop a second time: its ratio is the noise floor.
FRAMEWORKS = {"hand-written": hand_written, "hand again": hand_written,
              "transformers": hf_trainer, "shoal": shoal_trainer}


def run(name: str, steps: int, batch: int) -> float:
    data, _ = build_data(seq_len=128, max_bytes=2_000_000, causal_lm=True)
    stamps: list[float] = []
    FRAMEWORKS[name](data, steps, batch, stamps)
    return statistics.median(b - a for a, b in zip(stamps[10:], stamps[11:], strict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    peers = importlib.util.find_spec("accelerate") is not None
    names = [n for n in FRAMEWORKS if peers or n != "transformers"]
    results: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            ranks = shoal.spawn(run, nprocs=args.nproc, args=(name, args.steps, args.batch_size))
            results[name].append(max(ranks))
    base = results["hand-written"]
    print(f"hf: transformers GPT-2 (0.84 M parameters, 128 tokens), AdamW, {args.nproc} "
          f"processes (gloo), batch {args.batch_size}/process, {args.steps} steps, "
          f"{args.repeats} interleaved rounds; medians")
    print(f"{'framework':<13} {'step ms':>8} {'vs hand-written':>16}")
    for name in names:
        ratio = statistics.median(s / b for s, b in zip(results[name], base, strict=True))
        print(f"{name:<13} {statistics.median(results[name]) * 1e3:>8.2f} {ratio:>15.3f}x")
    if "transformers" in results:
        ratio = statistics.median(s / t for s, t in zip(results["shoal"],
                                                         results["transformers"], strict=True))
        print(f"shoal vs the transformers Trainer: {ratio:.3f}x")
    else:
        print("the transformers Trainer left out: it needs accelerate "
              "(pip install -e '.[hf,bench]')")


if __name__ == "__main__":
    main()
