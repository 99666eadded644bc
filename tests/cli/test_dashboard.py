"""`shoal train --dashboard`: node 0 serves the run's dashboard while it trains, tells an
open page when it stops, and the run's metrics.jsonl holds what the page draws (starts,
validations, per-rank step times, the end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

from tests.dashboard.conftest import EventStream
from tests.helpers import REPO


def test_train_serves_its_dashboard_while_it_runs(tmp_path):
    run_dir = tmp_path / "digits"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal", "train", "--config", "examples/digits.yaml",
         "--nproc-per-node", "2", "--dashboard", "--dashboard-port", "0",
         "trainer.epochs=6", "trainer.metrics.every=5", f"run.dir={run_dir}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        url = None
        while url is None and time.monotonic() < deadline:
            url = next((line.split(" is at ")[1].strip() for line in lines
                        if "the run's dashboard is at" in line), None)
            time.sleep(0.1)
        assert url and url.startswith("http://127.0.0.1:"), lines
        page = EventStream(url.rstrip("/"))  # a page open until the job is over
        points = 0
        while points == 0 and proc.poll() is None:  # served while the job trains
            snapshot = json.loads(urllib.request.urlopen(url + "api/snapshot",
                                                         timeout=10).read())
            points = len(snapshot["runs"][0]["points"])
            time.sleep(0.2)
        assert points > 0 and snapshot["runs"][0]["name"] == "digits"
        assert proc.wait(timeout=150) == 0, "".join(lines[-40:])
        # The page was told: the run's end, then that the server stopped.
        seen = []
        while not seen or seen[-1][0] != "closed":
            seen.append(page.next(timeout=10))
        page.close()
        changes = [c for name, data in seen for c in
                   (data["runs"] if name == "snapshot" else data if name == "changes" else [])]
        kinds = [e["kind"] for change in changes for e in change.get("events", [])]
        assert kinds[-1] == "end", kinds
    finally:
        proc.kill()
        reader.join(timeout=10)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in records if r["type"] == "event"]
    assert [e["kind"] for e in events] == ["start", "end"]
    assert events[0]["world_size"] == 2 and events[0]["memory_limit_bytes"] > 0
    validations = [r for r in records if r["type"] == "validation"]
    assert [v["epoch"] for v in validations] == list(range(6))
    assert all(0 <= v["val_accuracy"] <= 1 for v in validations)
    steps = [r for r in records if r["type"] == "step"]
    assert all(len(r["rank_step_s"]) == len(r["rank_comm_s"]) == 2 for r in steps)
    # The workers' heartbeats are in the run directory, where the dashboard looks for them.
    assert len(list(run_dir.glob("logs/*/heartbeats/rank*.beat"))) == 2
