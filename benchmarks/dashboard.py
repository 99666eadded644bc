"""The dashboard's weight: first paint of a million-step run, and the server's CPU while a
job writes.

1. First paint: a metrics.jsonl of 1,000,000 step lines (and a per-rank window every 50
   steps, 444 MB), as shoal writes them. Prints how long the dashboard takes to read it
   (thinned to its point cap; in the benchmark's process, imports excluded), side by side
   with parsing every line with json.loads (what a dashboard that keeps every point must at
   least do), and how long headless Chromium takes from opening the page to drawn charts.
   Target: reading plus painting within 2 s.
2. CPU: `shoal dashboard` in its own process with one page open, while a writer appends a
   step every 10 ms (100 steps/s, a window every 50) for --seconds. Prints the server
   process's CPU time over that span as a share of one core, side by side with the
   writer's own. Target: under 5 %. And how far the page's last step is behind the file,
   looked at every half second. Target: within 2 s.

--screenshot PNG instead trains digits on 2 processes with rank 1's data loading slowed
(a planted straggler), then saves the dashboard of that run (docs/images/dashboard.png).

Needs the test extra (selenium) and Debian's chromium and chromium-driver. A measurement,
not a test: exits 0.

    python benchmarks/dashboard.py [--lines 1000000] [--seconds 30]
    python benchmarks/dashboard.py --screenshot docs/images/dashboard.png
"""

# ruff: noqa: E402
import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shoal.dashboard.server import Server, create_app
from tests.dashboard.synthetic import event_line, step_line, window_line


def write_run(path: Path, lines: int) -> None:
    template = step_line(123456789, slow_rank=1)
    window = window_line(1, 50, slow_rank=1)
    with open(path, "w") as f:
        f.write(event_line("start", 0) + "\n")
        buffer = []
        for step in range(1, lines + 1):
            buffer.append(template.replace("123456789", str(step)))
            if step % 50 == 0:
                buffer.append(window)
            if len(buffer) >= 10_000:
                f.write("\n".join(buffer) + "\n")
                buffer = []
        if buffer:
            f.write("\n".join(buffer) + "\n")


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1400"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


def first_paint(driver, url: str) -> float:
    start = time.perf_counter()
    driver.get(url)
    while not driver.execute_script("return document.body.dataset.lastStep"):
        time.sleep(0.01)
    return time.perf_counter() - start


def paint_benchmark(lines: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "million"
        run.mkdir()
        write_run(run / "metrics.jsonl", lines)
        size = (run / "metrics.jsonl").stat().st_size
        with open(run / "metrics.jsonl", "rb") as f:  # both start from the page cache
            while f.read(64 << 20):
                pass
        start = time.perf_counter()
        with open(run / "metrics.jsonl", "rb") as f:
            parsed = sum(1 for line in f if json.loads(line))
        naive = time.perf_counter() - start
        start = time.perf_counter()
        app = create_app([run])
        load = time.perf_counter() - start
        points = len(app.state.hub.runs[0].points)
        server = Server(app, "127.0.0.1", 0).start()
        driver = browser()
        try:
            paints = [first_paint(driver, f"http://127.0.0.1:{server.port}/") for _ in range(3)]
        finally:
            driver.quit()
            server.stop()
    cold = paints[0]  # the browser's first opening of the page: nothing cached
    print(f"first paint of {lines:,} steps ({parsed:,} lines, {size / 1e6:.0f} MB):")
    print(f"  read by the dashboard    {load:6.2f} s  ({points:,} points kept)")
    print(f"  json.loads of each line  {naive:6.2f} s  ({naive / load:.1f}x the dashboard)")
    print(f"  page to drawn charts     {cold:6.2f} s  (first opening; then "
          + ", ".join(f"{p:.2f}" for p in paints[1:]) + " s)")
    print(f"  read + first paint       {load + cold:6.2f} s  (target < 2 s)")


class Writer(threading.Thread):
    def __init__(self, path: Path, period: float):
        super().__init__(daemon=True)
        self.path, self.period, self.stop, self.steps = path, period, False, 0

    def run(self):
        with open(self.path, "a", buffering=1) as f:
            next_at = time.perf_counter()
            while not self.stop:
                self.steps += 1
                f.write(step_line(self.steps, slow_rank=1) + "\n")
                if self.steps % 50 == 0:
                    f.write(window_line(self.steps - 49, self.steps, slow_rank=1) + "\n")
                next_at += self.period
                time.sleep(max(0.0, next_at - time.perf_counter()))


def cpu_benchmark(seconds: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "live"
        run.mkdir()
        (run / "metrics.jsonl").write_text(event_line("start", 0) + "\n")
        proc = subprocess.Popen([sys.executable, "-m", "shoal", "dashboard", str(run),
                                 "--port", "0"], stdout=subprocess.PIPE, text=True, cwd=REPO)
        driver = None
        try:
            url = proc.stdout.readline().split(" at ")[1].split()[0]
            driver = browser()
            driver.get(url)
            server = psutil.Process(proc.pid)
            writer = Writer(run / "metrics.jsonl", 0.01)
            writer.start()
            time.sleep(2)  # the page is connected and receiving
            own = psutil.Process()
            server_before, own_before = server.cpu_times(), own.cpu_times()
            start = time.perf_counter()
            lags = []  # how far behind the writer the page is, every half second
            while time.perf_counter() - start < seconds:
                time.sleep(0.5)
                written = writer.steps
                page = int(driver.execute_script("return document.body.dataset.lastStep") or 0)
                lags.append((written - page) * writer.period)
            wall = time.perf_counter() - start
            server_after, own_after = server.cpu_times(), own.cpu_times()
            writer.stop = True
            writer.join()
            shown = int(driver.execute_script("return document.body.dataset.lastStep") or 0)
        finally:
            if driver:
                driver.quit()
            proc.terminate()
            proc.wait(timeout=10)
    used = (server_after.user + server_after.system - server_before.user
            - server_before.system) / wall
    writing = (own_after.user + own_after.system - own_before.user - own_before.system) / wall
    print(f"server CPU while a job writes 100 steps/s for {wall:.0f} s, one page open:")
    print(f"  dashboard server  {used:6.1%} of one core  (target < 5 %)")
    print(f"  the writer        {writing:6.1%} of one core (this process: writer and browser "
          "driver)")
    print(f"  page showed step {shown:,} of {writer.steps:,} written")
    lags.sort()
    print(f"  page behind the file  median {lags[len(lags) // 2]:.2f} s, worst "
          f"{lags[-1]:.2f} s over {len(lags)} looks  (target: new lines on the page within 2 s)")


class SlowOnRank1:
    """Digits, where loading a sample on rank 1 takes 1 ms longer."""

    def __init__(self, data):
        import shoal

        self.data, self.slow = data, shoal.rank() == 1

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        if self.slow:
            time.sleep(0.001)
        return self.data[index]


def train_with_straggler(run_dir: str) -> None:
    import torch

    import shoal
    from shoal.examples.digits import build_data, build_model

    shoal.init("gloo")
    train, val = build_data()
    model = build_model()
    trainer = shoal.Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                            loss_fn=torch.nn.functional.cross_entropy, batch_size=16,
                            seed=0, progress=False,
                            metrics={"dir": run_dir, "every": 10, "tensorboard": False})
    trainer.fit(SlowOnRank1(train), val, epochs=6)


def screenshot(path: Path) -> None:
    import shoal

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "digits-2ranks"
        shoal.spawn(train_with_straggler, nprocs=2, args=(str(run),))
        server = Server(create_app([run]), "127.0.0.1", 0).start()
        driver = browser()
        try:
            driver.set_window_size(1400, 1250)
            first_paint(driver, f"http://127.0.0.1:{server.port}/")
            time.sleep(1)
            driver.save_screenshot(str(path))
        finally:
            driver.quit()
            server.stop()
    print(f"saved {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--screenshot", type=Path, default=None, metavar="PNG")
    args = parser.parse_args()
    if args.screenshot:
        screenshot(args.screenshot)
        return
    paint_benchmark(args.lines)
    cpu_benchmark(args.seconds)


if __name__ == "__main__":
    main()
