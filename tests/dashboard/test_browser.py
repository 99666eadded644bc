"""The page in a real headless Chromium: a run still being written, drawn live, no errors."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from tests.dashboard.synthetic import event_line, run_lines, step_line, window_line

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser():
    if not (CHROMIUM and DRIVER):
        message = "needs Debian's chromium and chromium-driver (.ci/run installs them)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1400"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    yield driver
    driver.quit()


def _wait(driver, script, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out: {script}; console: {driver.get_log('browser')}")


class Writer(threading.Thread):
    """A job's rank 0 as the dashboard sees it: a step every 50 ms, a window every 10."""

    def __init__(self, directory, first):
        super().__init__(daemon=True)
        self.path, self.step, self.stop = directory / "metrics.jsonl", first, False

    def run(self):
        with open(self.path, "a", buffering=1) as f:
            while not self.stop:
                self.step += 1
                f.write(step_line(self.step, slow_rank=1) + "\n")
                if self.step % 10 == 0:
                    f.write(window_line(self.step - 9, self.step, slow_rank=1) + "\n")
                time.sleep(0.05)


def _errors(driver):
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


@pytest.mark.timeout(120)
def test_a_run_being_written_is_drawn_live(serve, browser, tmp_path):
    run = tmp_path / "digits"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "\n".join([event_line("start", 0)] + run_lines(200, slow_rank=1)
                  + [event_line("start", 150, restart=1)] + run_lines(50, start=151,
                                                                      slow_rank=1)) + "\n")
    writer = Writer(run, 200)
    base = serve([run], token="t0k")
    writer.start()
    try:
        browser.get(f"{base}/?token=t0k")
        first = int(_wait(browser, "return document.body.dataset.lastStep"))
        assert first >= 200
        # Later steps reach the page (how soon: benchmarks/dashboard.py; _wait's 10 s is a
        # hang guard).
        later = int(_wait(browser, f"const s = document.body.dataset.lastStep; "
                                   f"return Number(s) > {writer.step} && s"))
        assert later > first
    finally:
        writer.stop = True
        writer.join()
    # The straggler by name and phase, the heatmap drawn, every chart there.
    banner = _wait(browser, "return document.getElementById('straggler').textContent")
    assert "rank 1, in its data phase" in banner
    assert browser.execute_script("""
        const c = document.getElementById('heat-comm');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        return new Set(Array.from(d.filter((_, i) => i % 4 === 0))).size;""") > 1
    assert browser.execute_script("return document.querySelectorAll('.uplot').length") >= 6
    assert _errors(browser) == []


@pytest.mark.timeout(120)
def test_runs_overlaid_and_an_alert_shown(serve, browser, tmp_path):
    dirs = []
    for name, steps in (("first", 120), ("second", 80)):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("\n".join(
            [event_line("start", 0)] + run_lines(steps) + [step_line(steps + 1, loss=float("nan"))]
        ) + "\n")
        dirs.append(d)
    base = serve(dirs)
    browser.get(base + "/")
    _wait(browser, "return document.body.dataset.lastStep")
    legend = browser.execute_script(
        "return Array.from(document.querySelectorAll('#loss .u-legend th'))"
        ".map(e => e.textContent).join('|')")
    assert "first loss" in legend and "second loss" in legend
    alerts = _wait(browser, "return document.getElementById('alerts').textContent")
    assert "first: the loss is not finite at step 121" in alerts
    assert "second: the loss is not finite at step 81" in alerts
    assert _errors(browser) == []


T0 = 1_700_000_000.0  # the records' own times: the page shows the newest one


def _timed_run(directory, steps: int, world: int = 2) -> None:
    lines = [event_line("start", 0, now=T0)]
    for step in range(1, steps + 1):
        lines.append(step_line(step, world=world, slow_rank=1, now=T0 + step))
        if step % 10 == 0:
            lines.append(window_line(step - 9, step, world=world, slow_rank=1, now=T0 + step))
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _status(driver) -> str:
    return driver.execute_script("return document.getElementById('status').textContent")


@pytest.mark.timeout(120)
def test_the_page_says_when_its_data_is_from_and_that_the_run_ended(serve, browser, tmp_path):
    _timed_run(tmp_path, 40)
    base = serve([tmp_path], token="t0k")
    browser.get(base + "/")  # without its token: the page says what is missing
    text = browser.find_element("tag name", "body").text
    assert "This dashboard needs its token" in text and "?token=" in text
    browser.get(base + "/?token=t0k")
    assert _wait(browser, "return document.body.dataset.updated") == str(int(T0 + 40))
    shown = browser.execute_script(f"return new Date({1000 * (T0 + 40)}).toLocaleTimeString()")
    assert _status(browser).endswith(f": step 40 · updated {shown}")
    assert [e for e in _errors(browser) if "status of 401" not in e["message"]] == []
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(event_line("end", 40, now=T0 + 45) + "\n")
    _wait(browser, "return document.body.dataset.ended === 'true'")
    shown = browser.execute_script(f"return new Date({1000 * (T0 + 45)}).toLocaleTimeString()")
    assert _status(browser).endswith(f": step 40 · ended · updated {shown}")
    serve.servers[-1].stop()  # as `shoal train --dashboard` does when the job is over
    _wait(browser, "return document.body.dataset.link === 'stopped'")
    time.sleep(4)  # past EventSource's retry: the page does not try again
    assert "server stopped at" in _status(browser) and "reconnecting" not in _status(browser)


@pytest.mark.timeout(120)
def test_a_stream_lost_before_the_end_is_retried(serve, browser, tmp_path):
    _timed_run(tmp_path, 20)
    base = serve([tmp_path])
    browser.get(base + "/")
    _wait(browser, "return document.body.dataset.link === 'live'")
    server = serve.servers[-1]
    server.server.should_exit = True  # gone without a word (killed, or the network)
    server.thread.join(10)
    _wait(browser, "return document.body.dataset.link === 'lost'")
    assert "connection lost at" in _status(browser) and "reconnecting" in _status(browser)
    assert "ended" not in _status(browser)


@pytest.mark.timeout(120)
def test_heatmaps_name_their_ranks_steps_and_scale(serve, browser, tmp_path):
    _timed_run(tmp_path, 300, world=4)
    base = serve([tmp_path])
    browser.get(base + "/")
    _wait(browser, "return document.getElementById('heat-comm').dataset.ranks")
    for id_ in ("heat-step", "heat-comm"):
        data = browser.execute_script(f"return document.getElementById('{id_}').dataset")
        assert data["ranks"] == "0,1,2,3", data
        steps = [int(s) for s in data["steps"].split(",")]
        assert len(steps) >= 3 and steps == sorted(steps) and steps[0] == 1, steps
        assert steps[-1] == 300
        lo, hi = map(float, data["scale"].split(","))
        assert 0 <= lo < hi or (id_ == "heat-step" and lo == hi)  # every rank's step: equal
    # Ink where the labels are, and a colour bar that runs from light (bottom) to dark.
    ink = browser.execute_script("""
        const c = document.getElementById('heat-comm'), ctx = c.getContext('2d');
        const dark = (x, y, w, h) => Array.from(ctx.getImageData(x, y, w, h).data)
          .filter((v, i) => i % 4 === 3 && v > 0).length;
        const bar = (y) => ctx.getImageData(c.width - 76 + 14, y, 1, 1).data[0];
        return {ranks: dark(0, 0, 48, c.height - 20), steps: dark(52, c.height - 20,
          c.width - 128, 20), scale: dark(c.width - 60, 0, 60, c.height),
          top: bar(1), bottom: bar(c.height - 22)};""")
    assert ink["ranks"] > 50 and ink["steps"] > 50 and ink["scale"] > 50, ink
    assert ink["top"] < ink["bottom"], ink
    assert _errors(browser) == []


@pytest.mark.timeout(120)
def test_a_run_of_random_lines_is_drawn_without_an_error(serve, browser, tmp_path):
    import random

    from tests.dashboard.hostile import random_line

    rng = random.Random(7)
    lines = [event_line("start", 0).encode()] + [random_line(rng, step) for step in range(1, 400)]
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines + [step_line(400).encode()])
                                             + b"\n")
    base = serve([tmp_path])
    browser.get(base + "/")
    _wait(browser, "return document.body.dataset.lastStep === '400'")
    assert _errors(browser) == []
