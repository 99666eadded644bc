"""What a remote call costs: the remote tier against a bare gRPC echo of the same bytes,
and a training step with one block remote against the same step all local.

1. Transport: a remote forward+backward of a tensor of 1 KB to 64 MB through a module that
   only scales it (one parameter: the time is the tier's, not the module's), on loopback,
   against a bare gRPC echo that moves the same bytes the same number of times (the tensor
   out and back for forward, and again for backward) in the same 1 MiB messages. Prints the
   median time of each and their ratio: the tier's own cost on top of gRPC (headers,
   sessions, the reply cache, tensor (de)serialisation, autograd).
2. Step: the digits MLP of the tests with a wider middle block (--width), batch --batch,
   trained --steps steps with the block local and with it on a loopback server, one
   thread each. Prints the time per step of each and the ratio.

Both servers run in their own processes. A measurement, not a test: exits 0.

    python benchmarks/remote.py [--max-mb 64] [--width 512] [--batch 64] [--steps 40]
"""

# ruff: noqa: E402
import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc
import torch
from torch import nn

from shoal.remote import GrpcRemoteTier, RemoteModule
from shoal.remote.server import channel_options
from shoal.remote.wire import CHUNK

ECHO = "/bench.Echo/Call"


class Scale(nn.Module):
    """y = w * x: one parameter, next to no compute."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.w * x


def scale() -> Scale:
    return Scale()


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def block(width: int) -> Block:
    return Block(width)


def _net(width: int, remote: GrpcRemoteTier | None) -> nn.Module:
    torch.manual_seed(0)
    middle = Block(width)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(),
                         RemoteModule(middle, tier=remote) if remote else middle,
                         nn.Linear(width, 10))


def _echo_server(port_file: str) -> None:
    """A bare gRPC echo: the messages of a stream come back as they are."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=channel_options())
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {
        "Call": grpc.stream_stream_rpc_method_handler(lambda it, ctx: (m for m in list(it)))})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


def _start(argv: list[str]) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    found = re.search(r" at \S+:(\d+) ", proc.stdout.readline())
    if not found:
        raise SystemExit("the remote server did not start")
    return proc, int(found.group(1))


def _serve(module: str, args: str = "{}") -> tuple[subprocess.Popen, int]:
    return _start([sys.executable, "-m", "shoal", "remote", "serve", "--module", module,
                   "--args", args, "--port", "0", "--threads", "1"])


def _median(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def transport(max_mb: int) -> None:
    port_file = Path(f"/tmp/shoal-bench-echo-{os.getpid()}")
    echo_proc = subprocess.Popen([sys.executable, __file__, "--echo-server", str(port_file)])
    tier_proc, port = _serve("benchmarks.remote:scale")
    try:
        while not port_file.exists():
            time.sleep(0.05)
        channel = grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}", channel_options())
        echo = channel.stream_stream(ECHO)
        remote = RemoteModule(Scale(), tier=GrpcRemoteTier({"endpoint": f"127.0.0.1:{port}"}))
        print(f"{'size':>8} {'remote fwd+bwd':>15} {'bare gRPC echo':>15} {'ratio':>6}")
        size = 1024
        while size <= max_mb << 20:
            x = torch.randn(size // 4, requires_grad=True)
            raw = x.detach().numpy().tobytes()
            chunks = [raw[i:i + CHUNK] for i in range(0, len(raw), CHUNK)] or [b""]

            def tier_call(x=x):
                remote(x).sum().backward()

            def echo_call(chunks=chunks):
                for _ in range(2):  # forward and backward: out and back each
                    for _ in echo(iter([b"{}", *chunks]), timeout=120):
                        pass
            repeats = 20 if size <= 1 << 20 else 5 if size <= 16 << 20 else 3
            a, b = _median(tier_call, repeats), _median(echo_call, repeats)
            label = f"{size >> 20} MB" if size >= 1 << 20 else f"{size >> 10} KB"
            print(f"{label:>8} {a * 1e3:>12.2f} ms {b * 1e3:>12.2f} ms {a / b:>5.2f}x",
                  flush=True)
            size *= 4
        remote.tier.close()
    finally:
        for proc in (echo_proc, tier_proc):
            proc.kill()
        port_file.unlink(missing_ok=True)


def step(width: int, batch: int, steps: int) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data[:batch], dtype=torch.float32) / 16
    y = torch.tensor(digits.target[:batch])
    proc, port = _serve("benchmarks.remote:block", f"{{width: {width}}}")
    try:
        tier = GrpcRemoteTier({"endpoint": f"127.0.0.1:{port}"})
        times = {}
        for name, net in (("local", _net(width, None)), ("remote", _net(width, tier))):
            opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

            def one(net=net, opt=opt):
                loss = nn.functional.cross_entropy(net(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            times[name] = _median(one, steps)
        params = sum(p.numel() for p in Block(width).parameters())
        print(f"\nstep, digits MLP with a {width}-wide block ({params:,} parameters remote), "
              f"batch {batch}: local {times['local'] * 1e3:.2f} ms, remote "
              f"{times['remote'] * 1e3:.2f} ms, ratio {times['remote'] / times['local']:.2f}x")
        tier.close()
    finally:
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-mb", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--echo-server", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo_server:
        return _echo_server(args.echo_server)
    torch.set_num_threads(1)
    transport(args.max_mb)
    step(args.width, args.batch, args.steps)


if __name__ == "__main__":
    main()
