"""Speed on one GPU: a raw DDP loop, shoal's Trainer, Lightning Fabric and Accelerate.

Workloads: the GPT of ``shoal.examples.gpt`` (12 layers, d_model 768, seq_len 1024, ~86M
parameters, batch 16, bf16 autocast, random token ids) and the digits MLP (hidden 512, batch
64, fp32). Every variant trains the same seeded model on the same data with AdamW, in a DDP
group of one process (NCCL on CUDA, gloo on CPU): ``raw`` (a hand-written loop),
``raw_compile`` (torch.compile after DDP), ``shoal`` (Trainer defaults, step metrics on),
``shoal_nometrics``, ``shoal_compile``, ``fabric`` and ``accelerate`` where installed, and on
request ``raw_again`` (raw once more: the noise floor of a ratio). Compiled variants run on
the GPT only, unless ``--mlp-compile``.

Each run is a fresh process; runs are interleaved over ``--repeats`` rounds, the order
rotating each round; figures are medians over rounds. An optimizer step post-hook, the same
everywhere, drains the device after ``--warmup`` steps and after the timed steps: step time
is that wall time over the steps (a GPU runs behind the CPU: only drained time is fair); the
median interval between hook calls (the CPU's view) is shown beside it. Tokens/s (samples/s
for the MLP), MFU (``GPT.flops_per_token``, 6 x parameters per MLP sample, over the peak of
``shoal.metrics.flops`` or ``--peak-tflops``), peak memory (allocated on a GPU, resident on a
CPU); then the ratios shoal has targets for. ``--profile VARIANT`` instead runs one variant
under torch.profiler for a few steps and prints where the CPU time goes (``--trace FILE``:
a Chrome trace too). A measurement, not a test: exits 0.

    python benchmarks/gpu.py [--repeats 3] [--steps 50] [--mlp-steps 300] [--warmup 10]
                             [--workloads gpt,mlp] [--variants raw,shoal,...] [--mlp-compile]
                             [--json FILE] [--profile VARIANT [--trace FILE]]
    python benchmarks/gpu.py --device cpu --steps 6 --mlp-steps 20 --warmup 2 --repeats 1 \\
        --gpt-layers 1 --gpt-d-model 64 --seq-len 64 --gpt-batch 2    # a smoke run on a CPU
"""

import argparse
import importlib.util
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import shoal
from shoal.examples import digits, gpt

SEED = 0
PROFILE_STEPS = 5
VARIANTS = ("raw", "raw_compile", "shoal", "shoal_nometrics", "shoal_compile", "fabric",
            "accelerate", "raw_again")
OPTIONAL = {"fabric": "lightning", "accelerate": "accelerate"}  # variant: the module it needs
# (label, workload, numerator, denominator, target) over step times; the last is a
# throughput ratio (raw_compile's step time over shoal_compile's), so there higher is better.
TARGETS = (("shoal/raw step time, GPT", "gpt", "shoal", "raw", "<= 1.02"),
           ("shoal/raw step time, MLP", "mlp", "shoal", "raw", "<= 1.05"),
           ("metrics on/off step time, GPT", "gpt", "shoal", "shoal_nometrics", "<= 1.02"),
           ("shoal_compile/raw_compile throughput, GPT", "gpt", "raw_compile",
            "shoal_compile", ">= 1.00"))


@dataclass
class Job:
    """What one run trains: the same in every variant."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: Dataset
    loss_fn: object
    batch: int
    precision: str  # shoal's name: "bf16-mixed" or "32"
    device: torch.device
    total_steps: int  # warm-up and timed
    items_per_step: int  # tokens (GPT) or samples (MLP)
    flops_per_item: float


class Window:
    """Optimizer step post-hook: times the steps after ``warmup``, with the device drained at
    both ends of the window (once each: a synchronize per step would change the steps)."""

    def __init__(self, device: torch.device, warmup: int, steps: int, profiler=None):
        self.device, self.warmup, self.steps, self.profiler = device, warmup, steps, profiler
        self.count, self.stamps, self.end = 0, [], None

    def __call__(self, *_) -> None:
        self.count += 1
        if self.count in (self.warmup, self.warmup + self.steps) and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.count == self.warmup and self.profiler:
            self.profiler.start()
        if self.count >= self.warmup:
            self.stamps.append(time.perf_counter())
        if self.count == self.warmup + self.steps:
            self.end = self.stamps[-1]
            if self.profiler:
                self.profiler.stop()


def build_job(workload: str, args, device: torch.device, steps: int) -> Job:
    total = args.warmup + steps
    if workload == "gpt":
        model = gpt.build_model(vocab_size=256, seq_len=args.seq_len, n_layer=args.gpt_layers,
                                n_head=max(1, args.gpt_d_model // 64),
                                d_model=args.gpt_d_model, seed=SEED)
        flops = getattr(model, "flops_per_token", None)  # else: 6N + attention
        flops = flops() if callable(flops) else 6 * gpt.count_parameters(model) \
            + 12 * args.gpt_layers * args.gpt_d_model * args.seq_len
        # One epoch holds every step: no epoch boundary inside the window.
        ids = torch.randint(0, 256, (args.gpt_batch * total, args.seq_len + 1),
                            generator=torch.Generator().manual_seed(SEED))
        return Job(model, torch.optim.AdamW(model.parameters(), lr=3e-4),
                   TensorDataset(ids[:, :-1], ids[:, 1:]), gpt.loss, args.gpt_batch,
                   "bf16-mixed", device, total, args.gpt_batch * args.seq_len, flops)
    model = digits.build_model(hidden=512, seed=SEED)
    return Job(model, torch.optim.AdamW(model.parameters(), lr=1e-3), digits.build_data()[0],
               nn.functional.cross_entropy, 64, "32", device, total, 64,
               6 * sum(p.numel() for p in model.parameters()))


def _train(job: Job, loader: DataLoader, step, set_epoch=None) -> None:
    done, epoch = 0, 0
    while True:
        if set_epoch:
            set_epoch(epoch)
        for inputs, targets in loader:
            step(inputs, targets)
            done += 1
            if done == job.total_steps:
                return
        epoch += 1


def run_raw(job: Job, compile: bool = False) -> nn.Module:
    cuda = job.device.type == "cuda"
    if cuda:
        torch.cuda.set_device(job.device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    model = DistributedDataParallel(job.model.to(job.device),
                                    device_ids=[job.device.index] if cuda else None)
    if compile:
        model = torch.compile(model)
    sampler = DistributedSampler(job.data, shuffle=True, seed=SEED)
    loader = DataLoader(job.data, batch_size=job.batch, sampler=sampler, pin_memory=cuda)
    bf16 = job.precision == "bf16-mixed"

    def step(inputs, targets):
        inputs = inputs.to(job.device, non_blocking=True)
        targets = targets.to(job.device, non_blocking=True)
        with torch.autocast(job.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = job.loss_fn(model(inputs), targets)
        loss.backward()
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
    _train(job, loader, step, sampler.set_epoch)
    dist.destroy_process_group()
    return model


def run_shoal(job: Job, metrics: bool = True, compile: bool = False) -> nn.Module:
    trainer = shoal.Trainer(job.model, job.optimizer, loss_fn=job.loss_fn, batch_size=job.batch,
                            max_steps=job.total_steps, precision=job.precision, progress=False,
                            seed=SEED, metrics={"enabled": metrics}, compile=compile,
                            backend="gloo" if job.device.type == "cpu" else None)
    trainer.fit(job.data)
    return trainer.model


def _shuffled_loader(job: Job) -> DataLoader:
    """What a framework is given; it adds the distributed sampler itself."""
    return DataLoader(job.data, batch_size=job.batch, shuffle=True,
                      pin_memory=job.device.type == "cuda")


def _framework_step(model, optimizer, loss_fn, backward):
    """The loop body under a framework, which moves batches and autocasts by itself."""
    def step(inputs, targets):
        backward(loss_fn(model(inputs), targets))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def run_fabric(job: Job) -> nn.Module:
    from lightning.fabric import Fabric

    fab = Fabric(accelerator=job.device.type, devices=1, strategy="ddp",
                 precision="bf16-mixed" if job.precision == "bf16-mixed" else "32-true")
    fab.launch()
    model, optimizer = fab.setup(job.model, job.optimizer)
    loader = fab.setup_dataloaders(_shuffled_loader(job))
    _train(job, loader, _framework_step(model, optimizer, job.loss_fn, fab.backward),
           getattr(loader.sampler, "set_epoch", None))
    return model


def run_accelerate(job: Job) -> nn.Module:
    from accelerate import Accelerator

    # A one-process job described as torchrun would, so that Accelerate wraps in DDP.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    acc = Accelerator(cpu=job.device.type == "cpu",
                      mixed_precision="bf16" if job.precision == "bf16-mixed" else "no")
    model, optimizer, loader = acc.prepare(job.model, job.optimizer, _shuffled_loader(job))
    _train(job, loader, _framework_step(model, optimizer, job.loss_fn, acc.backward),
           getattr(loader, "set_epoch", None))
    return model


RUNNERS = {"raw": run_raw, "raw_again": run_raw,
           "raw_compile": lambda job: run_raw(job, compile=True),
           "shoal": run_shoal, "shoal_nometrics": lambda job: run_shoal(job, metrics=False),
           "shoal_compile": lambda job: run_shoal(job, compile=True),
           "fabric": run_fabric, "accelerate": run_accelerate}


def child(args) -> None:
    """One run in this fresh process; its figures go to the file ``args.result``."""
    workload, variant = args.child.split(":")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    steps = args.steps if workload == "gpt" else args.mlp_steps
    steps = min(steps, PROFILE_STEPS) if args.profile else steps
    job = build_job(workload, args, device, steps)
    activities = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = torch.profiler.profile(activities=activities) if args.profile else None
    window = Window(device, args.warmup, steps, profiler)
    job.optimizer.register_step_post_hook(window)
    wrapper = type(RUNNERS[variant](job)).__name__
    if window.end is None:
        raise RuntimeError(f"{variant} took {window.count} optimizer steps, not "
                           f"{job.total_steps}")
    if profiler:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        if args.trace:
            profiler.export_chrome_trace(args.trace)
            print(f"Chrome trace: {args.trace}")
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    if peak is None and importlib.util.find_spec("shoal.metrics.flops"):
        from shoal.metrics.flops import peak_flops
        peak = peak_flops(device, job.precision)
    memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    intervals = [b - a for a, b in zip(window.stamps, window.stamps[1:], strict=False)]
    with open(args.result, "w") as f:
        json.dump({"workload": workload, "variant": variant, "wrapper": wrapper,
                   "step_s": (window.end - window.stamps[0]) / steps,
                   "hook_step_s": statistics.median(intervals),
                   "peak_memory_mb": memory / 2**20, "items_per_step": job.items_per_step,
                   "flops_per_item": job.flops_per_item, "peak_flops": peak,
                   "params": sum(p.numel() for p in job.model.parameters())}, f)


def spawn_run(workload: str, variant: str, env: dict) -> dict | None:
    """One run in a fresh process, started with this script's own arguments."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        rc = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:],
                             "--child", f"{workload}:{variant}", "--result", result],
                            env=env).returncode
        if rc != 0:
            print(f"{workload} {variant} failed (exit {rc}): left out of this round",
                  file=sys.stderr)
            return None
        with open(result) as f:
            return json.load(f)


def _ratio(runs: list, base: list) -> float | None:
    """Median over rounds of the step-time ratio within a round (runs that failed skipped)."""
    pairs = [a["step_s"] / b["step_s"] for a, b in zip(runs, base, strict=False) if a and b]
    return statistics.median(pairs) if pairs else None


def report(workload: str, names: list[str], runs: dict, args) -> list[dict]:
    """Prints the table of one workload; returns its rows."""
    done = {n: [r for r in runs[(workload, n)] if r] for n in names}
    first = next((rs[0] for rs in done.values() if rs), None)
    if first is None:
        print(f"\n{workload}: no run finished")
        return []
    item, peak = "tokens" if workload == "gpt" else "samples", first["peak_flops"]
    shape = (f"{args.gpt_layers} layers, d_model {args.gpt_d_model}, seq_len {args.seq_len}, "
             f"batch {args.gpt_batch}, bf16-mixed" if workload == "gpt" else
             "hidden 512, batch 64, fp32")
    print(f"\n{workload}: {first['params'] / 1e6:.1f}M parameters, {shape}, AdamW; peak "
          f"{f'{peak / 1e12:.4g} TFLOP/s' if peak else 'unknown'}; medians of {args.repeats}")
    print(f"{'variant':<16} {'step ms':>9} {'hook ms':>9} {'vs raw':>7} {item + '/s':>12} "
          f"{'MFU':>6} {'peak MB':>9}  wrapper")
    rows = []
    for name, rs in done.items():
        if not rs:
            continue
        step = statistics.median(r["step_s"] for r in rs)
        rate = first["items_per_step"] / step
        rows.append({"workload": workload, "variant": name, "step_ms": step * 1e3,
                     "hook_step_ms": statistics.median(r["hook_step_s"] for r in rs) * 1e3,
                     "ratio_to_raw": _ratio(runs[(workload, name)], runs[(workload, "raw")]),
                     "items_per_s": rate, "mfu": rate * first["flops_per_item"] / peak
                     if peak else None, "wrapper": rs[0]["wrapper"],
                     "peak_memory_mb": statistics.median(r["peak_memory_mb"] for r in rs)})
        row = rows[-1]
        ratio = f"{row['ratio_to_raw']:.3f}" if row["ratio_to_raw"] else "-"
        mfu = f"{row['mfu']:.1%}" if row["mfu"] else "-"
        print(f"{name:<16} {row['step_ms']:>9.2f} {row['hook_step_ms']:>9.2f} {ratio:>7} "
              f"{rate:>12,.0f} {mfu:>6} {row['peak_memory_mb']:>9,.0f}  {row['wrapper']}")
    return rows


def key_ratios(runs: dict) -> list[dict]:
    print("\nkey ratios (median over rounds of the ratio within a round):")
    ratios = []
    for label, workload, num, den, target in TARGETS:
        value = _ratio(runs.get((workload, num), []), runs.get((workload, den), []))
        if value is None:
            print(f"  {label:<42} -      (not run)")
            continue
        bound = float(target[3:])
        met = value <= bound if target.startswith("<=") else value >= bound
        ratios.append({"label": label, "ratio": value, "target": target, "met": met})
        print(f"  {label:<42} {value:.3f}  target {target}: {'met' if met else 'NOT met'}")
    return ratios


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", default="gpt,mlp")
    parser.add_argument("--variants", default=",".join(VARIANTS[:-1]), help=", ".join(VARIANTS))
    parser.add_argument("--mlp-compile", action="store_true", help="compiled MLP variants too")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50, help="timed GPT steps")
    parser.add_argument("--mlp-steps", type=int, default=300, help="timed MLP steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--gpt-layers", type=int, default=12)
    parser.add_argument("--gpt-d-model", type=int, default=768, help="heads: d_model / 64")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--gpt-batch", type=int, default=16)
    parser.add_argument("--peak-tflops", type=float, help="peak of the device, for MFU")
    parser.add_argument("--json", help="write every run, table row and ratio to this file")
    parser.add_argument("--profile", metavar="VARIANT", choices=VARIANTS,
                        help="profile this variant on the first workload instead")
    parser.add_argument("--trace", help="with --profile: write a Chrome trace here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1 or min(args.steps, args.mlp_steps) < 2:
        parser.error("--warmup must be at least 1, --steps and --mlp-steps at least 2")
    if "raw" not in args.variants.split(","):
        parser.error("--variants must include raw: every ratio is to raw")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    env = dict(os.environ)
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")  # as the other benchmarks: no oversubscription
    workloads = args.workloads.split(",")
    if args.profile:
        result = spawn_run(workloads[0], args.profile, env)
        if result:
            print(f"{workloads[0]} {args.profile}: {result['step_s'] * 1e3:.2f} ms/step over "
                  "the profiled steps (the profiler's cost included)")
        return
    missing = {v: m for v, m in OPTIONAL.items() if importlib.util.find_spec(m) is None}
    wanted = [v for v in args.variants.split(",") if v not in missing]
    plan = {w: [v for v in wanted if w == "gpt" or args.mlp_compile or "compile" not in v]
            for w in workloads}
    runs: dict = {(w, v): [] for w in workloads for v in plan[w]}
    for r in range(args.repeats):
        for w in workloads:
            for name in plan[w][r % len(plan[w]):] + plan[w][:r % len(plan[w])]:
                result = spawn_run(w, name, env)
                runs[(w, name)].append(result and {**result, "round": r})
                print(f"round {r + 1}/{args.repeats}: {w} {name}: " + (
                      f"{result['step_s'] * 1e3:.2f} ms/step" if result else "failed"),
                      file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"\ngpu: {device}, one process, torch {torch.__version__}; {args.warmup} warm-up "
          f"steps, then {args.steps} (GPT) / {args.mlp_steps} (MLP) timed; {args.repeats} "
          f"interleaved rounds, a fresh process per run; peak MB: "
          f"{'GPU allocated' if args.device == 'cuda' else 'resident (RSS)'}")
    rows = [row for w in workloads for row in report(w, plan[w], runs, args)]
    ratios = key_ratios(runs)
    if missing:
        print("not installed, left out: " + ", ".join(f"{v} ({m})" for v, m in missing.items())
              + " (pip install -e '.[bench]')")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": [r for rs in runs.values() for r in rs if r], "rows": rows,
                       "ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
