"""Plain DDP against shoal's communication options on a slow network (tc netem).

Makes two hosts of network namespaces (tests/multihost/hosts.py; needs root and iproute2),
limits each host's outgoing link to ``--rate`` with ``--delay`` of one-way latency (tc
netem; where the kernel has no netem, a token bucket for the rate and a user-space wire
with that latency between the hosts, tests/multihost/wire.py), and trains the digits
example there (``shoal train --config examples/digits.yaml``,
an MLP of ``--hidden`` units, one process per host) for ``--steps`` steps under each
option of benchmarks/communication.py. The step times come from the job's own step metrics
(metrics.jsonl; the mean over the steps after the first 5, so that the periodic meetings of
local SGD and DiLoCo count). Prints steps per second and the
speed-up over plain DDP, on the slow link and, with ``--unlimited``, on the same hosts
without netem. Options are interleaved over ``--repeats`` rounds. Accuracy at an equal
sample budget is benchmarks/communication.py's job. A measurement, not a test: exits 0.

    sudo python benchmarks/netem.py [--rate 100mbit] [--delay 5ms] [--steps 69]
                                    [--hidden 512] [--repeats 1] [--unlimited]
"""

# ruff: noqa: E402
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from communication import OPTIONS  # noqa: E402

from tests.multihost.hosts import Hosts, netem_unavailable, unavailable  # noqa: E402

CHOSEN = ["ddp", "fp16", "powersgd-r1", "topk-1%", "local_sgd-H8", "diloco-H32-m0.5"]
PORT = 29470


def _overrides(settings: dict) -> list[str]:
    return [f"trainer.{key}={json.dumps(value)}" for key, value in settings.items()]


def run(hosts: Hosts, name: str, steps: int, hidden: int, out: Path) -> float:
    """Median seconds per step of one 2-host run of option ``name``."""
    run_dir = out / name
    argv = [sys.executable, "-m", "shoal", "train", "--config",
            str(REPO / "examples" / "digits.yaml"), "--nproc-per-node", "1", "--nnodes", "2",
            "--master-addr", hosts.addr(0), "--master-port", str(PORT),
            f"run.dir={run_dir}", f"model.args.hidden={hidden}", f"trainer.max_steps={steps}",
            "trainer.epochs=1000", "trainer.progress=false", "trainer.metrics.every=10",
            *_overrides(OPTIONS[name])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    run_dir.mkdir(parents=True)
    logs = [run_dir / f"node{r}.log" for r in range(2)]
    nodes = [hosts.popen(r, [*argv[:10], "--node-rank", str(r), *argv[10:]], env=env,
                         stdout=logs[r].open("w"), stderr=subprocess.STDOUT)
             for r in range(2)]
    while all(node.poll() is None for node in nodes) or (
            any(node.poll() is None for node in nodes)
            and all(node.returncode in (None, 0) for node in nodes)):
        time.sleep(0.2)
    if any(node.returncode for node in nodes):  # one failed: the other would wait forever
        for r in range(2):
            hosts.kill_all(r)
        raise SystemExit(f"{name} failed:\n" + "\n".join(
            log.read_text()[-2000:] for log in logs))
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    times = [r["step_time_s"] for r in map(json.loads, lines)
             if r["type"] == "step" and r["step"] > 5]
    return sum(times) / len(times)  # a mean: the meeting steps of local SGD / DiLoCo count


def _seconds(text: str) -> float:
    """'5ms', '200us', '0.01s' (tc's notation) in seconds."""
    for unit, scale in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0)):
        if text.endswith(unit):
            return float(text[:-len(unit)]) * scale
    return float(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--delay", default="5ms")
    parser.add_argument("--steps", type=int, default=69,
                        help="5 warm-up steps, then 64: whole periods of 8 and 32")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--unlimited", action="store_true",
                        help="also run on the same hosts without netem")
    parser.add_argument("--only", help="comma-separated options (ddp is always run)")
    args = parser.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"netem benchmark: {why}")
    names = CHOSEN if not args.only else ["ddp", *(
        n for n in args.only.split(",") if n != "ddp")]
    no_netem = netem_unavailable()
    if no_netem:
        print(f"netem: {no_netem}: the latency comes from a user-space wire between the two "
              f"hosts (tests/multihost/wire.py), the {args.rate} limit from a token bucket "
              "(tbf)", flush=True)
    links = ["slow", "unlimited"] if args.unlimited else ["slow"]
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-netem-") as tmp:
        for link in links:
            delay = _seconds(args.delay) if link == "slow" and no_netem else None
            with Hosts(2, wire_delay=delay) as hosts:
                for i in range(2):
                    if link == "slow" and no_netem:
                        hosts.limit(i, args.rate)
                    elif link == "slow":
                        hosts.netem(i, rate=args.rate, delay=args.delay)
                for r in range(args.repeats):
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        out = Path(tmp) / f"{link}{r}"
                        times.setdefault((link, name), []).append(
                            run(hosts, name, args.steps, args.hidden, out))
    print(f"netem: digits MLP (hidden {args.hidden}), 2 hosts x 1 process (gloo), "
          f"{args.steps} steps, slow link {args.rate} + {args.delay} one way; mean step after 5")
    header = f"{'option':<17}" + "".join(
        f"{link + ' steps/s':>20}{'vs ddp':>9}" for link in links)
    print(header)
    for name in names:
        row = f"{name:<17}"
        for link in links:
            t = statistics.median(times[(link, name)])
            base = statistics.median(times[(link, "ddp")])
            row += f"{1 / t:>20.2f}{base / t:>8.2f}x"
        print(row)


if __name__ == "__main__":
    main()
