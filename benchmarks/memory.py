"""Memory per rank of ddp, zero1, zero2, fsdp, tp and pp, against the ideal figures; step time.

Each (strategy, world size) is a fresh job of W processes (``shoal.spawn``, gloo on CPU)
that trains shoal's GPT (``--params`` parameters or more, Ψ) with AdamW in fp32 for
``--steps`` steps through ``shoal.Harness``, batch 1 x ``--tokens`` tokens per process.
What each rank holds is counted from the tensors themselves (a sharded tensor counts its
local shard only) after forward, after backward, after the optimizer step, and under FSDP
as each block starts its forward (gathered); "state" is the largest sum over those points
of

    parameters (the shards a rank keeps) + parameters gathered whole for compute (FSDP)
    + gradients + optimizer state (ZeRO-1: this rank's share).

The ideal figures (ZeRO paper, fp32 + Adam): ddp 16Ψ, zero1 4Ψ + 4Ψ + 8Ψ/W, zero2
4Ψ + 12Ψ/W, fsdp 16Ψ/W. ``tp`` (tensor parallel over all W ranks, the ready transformer
plan) and ``pp`` (W pipeline stages, GPipe, one microbatch) split the model itself; their
ideal is 16Ψ/W too, which they exceed by what they do not split: under tp the embeddings,
norms and head stay whole on every rank, under pp the blocks are split in whole blocks and
the first and last stages also hold the embeddings and the head. Their step time is not
compared (every rank works on the same batch, a different amount of work than ddp's).
Not sampled: inside backward, FSDP holds one block's gathered
parameters and whole gradients for a moment (here a block is 1/7 of the model). Peak RSS
is each rank's ru_maxrss (the largest over ranks); "over start" subtracts the process's
size once torch is loaded and the process group is up. It includes DDP's gradient buckets,
activations, and the whole copy of the model that every rank builds before sharding it
(unless ``--meta``); "setup" is the peak until the model is set up.

Step time: the median step at W=2 over ``--repeats`` interleaved rounds of fresh jobs
(order rotating; glibc's allocator left as it is, unlike for the memory runs, see
``_memory_returned``), as a ratio to ddp in the same round, median over rounds. W=4 on a
2-core machine runs 4 processes on 2 cores: fine for memory, meaningless for time (not
shown). A measurement, not a test: exits 0.

    python benchmarks/memory.py [--params 50e6] [--worlds 1,2,4] [--repeats 3] [--meta]
"""

# ruff: noqa: E402
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one compute thread per process

import argparse
import contextlib
import resource
import statistics
import time

import torch
from torch.distributed.tensor import DTensor

import shoal
from shoal.examples import gpt

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "tp", "pp")
TIMED = ("ddp", "zero1", "zero2", "fsdp")  # the same work per step: step times compare
MB = 2**20


def ideal_bytes(strategy: str, params: int, world: int) -> float:
    """ZeRO's figures for fp32 weights and gradients and Adam's two fp32 moments."""
    psi = params
    return {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi / world,
            "zero2": 4 * psi + 12 * psi / world, "fsdp": 16 * psi / world,
            "tp": 16 * psi / world, "pp": 16 * psi / world}[strategy]


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO: this rank's own optimizer
    return sum(_local_bytes(v) for state in inner.state.values() if state
               for v in state.values() if isinstance(v, torch.Tensor))


def _fsdp_params(model: torch.nn.Module) -> list:
    """FSDP's records of the parameters it manages (empty for other strategies)."""
    from torch.distributed.fsdp import FSDPModule

    return [param for module in model.modules() if isinstance(module, FSDPModule)
            for group in getattr(module._get_fsdp_state(), "_fsdp_param_groups", None) or []
            for param in group.fsdp_params]


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    fsdp = _fsdp_params(model)
    # Under FSDP the module's parameters are the gathered ones between forward and
    # backward: the shards kept are FSDP's sharded parameters.
    kept = [p.sharded_param for p in fsdp] if fsdp else list(model.parameters())
    gathered = {out.untyped_storage().data_ptr(): out.untyped_storage().nbytes()
                for p in fsdp for out in getattr(p, "all_gather_outputs", [])}
    return {"params": sum(_local_bytes(p) for p in kept),
            "gathered": sum(gathered.values()),  # freed storage counts 0
            "grads": sum(_local_bytes(p.grad) for p in kept if p.grad is not None),
            "optimizer": _optimizer_bytes(optimizer)}


def run(strategy: str, config: dict, steps: int, tokens: int, device: str = "cpu") -> dict:
    """One rank of one job: memory figures and step times."""
    split = {"tp": {"tp": shoal.world_size()}, "pp": {"pp": shoal.world_size()}}
    harness = shoal.Harness(strategy=strategy if strategy not in split else "ddp",
                            parallel=split.get(strategy), seed=0,
                            pipeline={"schedule": "gpipe", "microbatches": 1})
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = gpt.build_model(**config, seed=0, device=device)
    n_params = gpt.count_parameters(model)
    model, optimizer = harness.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                     loss_fn=gpt.loss)
    setup_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pipeline = getattr(model, "stage", None)  # a PipelineModel: this rank's stage
    g = torch.Generator().manual_seed(harness.rank)
    samples, stamps = [], [time.perf_counter()]
    from torch.distributed.fsdp import FSDPModule

    held = pipeline or model
    for unit in held.modules():  # FSDP gathers each block just before its forward
        if isinstance(unit, FSDPModule) and unit is not held:
            unit.register_forward_pre_hook(
                lambda *_: samples.append(_state(held, optimizer)))
    for _ in range(steps):
        ids = torch.randint(0, config["vocab_size"], (1, tokens + 1), generator=g)
        if pipeline is not None:  # forward and backward of every stage in one call
            model.step(ids[:, :-1], ids[:, 1:])
        else:
            loss = gpt.loss(model(ids[:, :-1]), ids[:, 1:])
            samples.append(_state(held, optimizer))
            harness.backward(loss)
        samples.append(_state(held, optimizer))
        harness.step(optimizer)
        samples.append(_state(held, optimizer))
        stamps.append(time.perf_counter())
    peak = max(samples, key=lambda s: sum(s.values()))
    return {"n_params": n_params, "peak": peak, "state": sum(peak.values()),
            "grads": max(s["grads"] for s in samples),
            "optimizer": max(s["optimizer"] for s in samples),
            "params": samples[-1]["params"],
            "gathered": max(s["gathered"] for s in samples),
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "start_rss": start_rss, "setup_rss": setup_rss,
            # the first step also allocates the optimizer state: left out of the time
            "step": statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:],
                                                            strict=False))}


@contextlib.contextmanager
def _memory_returned() -> None:
    """Workers started inside give freed memory back to the system at once.

    glibc raises its mmap threshold each time a large block is freed; blocks below it are
    then kept in the heap when freed, and RSS only grows (FSDP frees a gathered block per
    layer). A fixed threshold gives them back, so RSS follows live memory; but every large
    allocation then costs fresh pages, so step times are taken without it.
    """
    before = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by each worker when it starts
    try:
        yield
    finally:
        if before is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = before


def _job(strategy: str, world: int, config: dict, steps: int, tokens: int,
         device: str = "cpu") -> dict:
    ranks = shoal.spawn(run, nprocs=world, args=(strategy, config, steps, tokens, device))
    worst = max(ranks, key=lambda r: r["state"])
    return {**worst, "rss": max(r["rss"] for r in ranks),
            "rss_over_start": max(r["rss"] - r["start_rss"] for r in ranks),
            "setup_over_start": max(r["setup_rss"] - r["start_rss"] for r in ranks),
            "step": max(r["step"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50e6,
                        help="at least this many parameters (GPT of width 768, 12 heads)")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per process per step")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timing rounds at W=2 (0: memory only)")
    parser.add_argument("--meta", action="store_true",
                        help="build the model on the meta device: each rank allocates only "
                             "its part (the memory runs only)")
    args = parser.parse_args()
    shape = gpt.config_for_parameters(int(args.params), d_model=args.d_model,
                                      n_head=args.n_head, seq_len=max(args.tokens, 16))
    config = shape.model_dump(exclude={"dropout"})
    strategies = args.strategies.split(",")
    worlds = [int(w) for w in args.worlds.split(",")]
    with _memory_returned():
        results = {(s, w): _job(s, w, config, args.steps, args.tokens,
                                "meta" if args.meta else "cpu")
                   for w in worlds for s in strategies if w > 1 or s not in ("tp", "pp")}
    timed = [s for s in strategies if s in TIMED]
    times: dict[str, list[float]] = {s: [] for s in timed}
    if args.repeats and 2 in worlds and "ddp" in strategies:
        rounds = []
        for r in range(args.repeats):
            order = timed[r % len(timed):] + timed[:r % len(timed)]
            rounds.append({s: _job(s, 2, config, args.steps, args.tokens)["step"]
                           for s in order})
        for s in timed:
            times[s] = [x[s] for x in rounds]
            results[(s, 2)]["ratio"] = statistics.median(x[s] / x["ddp"] for x in rounds)
    psi = next(iter(results.values()))["n_params"]
    print(f"memory: GPT {shape.n_layer} layers x d_model {shape.d_model} ({psi:,} parameters "
          f"= Ψ), AdamW fp32, batch 1 x {args.tokens} tokens per process, {args.steps} steps, "
          "gloo on CPU; MB = 2^20 bytes, per rank (the largest rank)")
    print(f"{'strategy':<9}{'W':>2} {'params':>8} {'gathered':>9} {'grads':>8} {'optim':>8} "
          f"{'state':>8} {'ideal':>8} {'ratio':>6} {'peak RSS':>9} {'over start':>11} "
          f"{'setup':>6} {'step vs ddp':>12}")
    for w in worlds:
        for s in strategies:
            if (s, w) not in results:
                continue
            r = results[(s, w)]
            ideal = ideal_bytes(s, psi, w)
            step = f"{r['ratio']:.2f}x" if "ratio" in r else ""
            print(f"{s:<9}{w:>2} {r['params'] / MB:>8.0f} {r['gathered'] / MB:>9.0f} "
                  f"{r['grads'] / MB:>8.0f} {r['optimizer'] / MB:>8.0f} {r['state'] / MB:>8.0f} "
                  f"{ideal / MB:>8.0f} {r['state'] / ideal:>6.2f} {r['rss'] / MB:>9.0f} "
                  f"{r['rss_over_start'] / MB:>11.0f} {r['setup_over_start'] / MB:>6.0f} "
                  f"{step:>12}")
    if any(times.values()):
        print(f"step time at W=2 (median over {len(times['ddp'])} interleaved rounds, "
              "seconds): " + ", ".join(f"{s} {statistics.median(t):.2f}"
                                       for s, t in times.items()))
    print("params: shards kept between steps; gathered: parameters FSDP held whole at once "
          "(max); grads, optim: max over the step; state: max over the step of their sum; "
          "setup: peak RSS over start until the model is set up (built, split, "
          f"initialised{', on the meta device' if args.meta else ''}).")


if __name__ == "__main__":
    main()
