"""MLflow beside TensorBoard, against a real tracking server (sqlite store) started here: a
2-process `shoal train` logs one run from rank 0, a run killed and resumed continues it,
and a server that cannot be reached is one line before any worker starts."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from shoal.checkpoint import CheckpointStore
from shoal.checkpoint.layout import STEP_DIR
from shoal.config.loader import apply_override, validate_run_tree
from shoal.launch.ports import free_port
from shoal.metrics.mlflow import MLflowConfig, MLflowRun
from tests.helpers import REPO, processes_with, run_shoal, run_shoal_in_process

# Two epochs: the kill lands in the first, and the resume validates both.
EPOCHS, STEPS_PER_EPOCH = 2, 23  # digits: 1437 training samples / (2 ranks x 32)
STEPS = EPOCHS * STEPS_PER_EPOCH
KILL_AFTER = 8  # the first run is killed once a checkpoint of this step or later is committed
# Hang guards, several times the idle time, so that a loaded machine (3 xdist workers on
# 2 cores, another process busy) never meets them: the server is healthy in ~12 s alone
# (its first start builds the database); the killed run commits step KILL_AFTER in ~15 s,
# the resume ends in ~12 s; a SIGKILLed launcher is gone, and its workers after it, at once.
SERVER_START_S = 240
FIRST_RUN_S, RESUME_S, KILLED_GONE_S = 150, 150, 30
# pytest-timeout counts the fixtures' setup: above the sum of the guards a test may sit out.
MODULE_SETUP_S = SERVER_START_S + FIRST_RUN_S + 2 * KILLED_GONE_S + RESUME_S + 60


@pytest.fixture(scope="module", autouse=True)
def server(tmp_path_factory):
    """`mlflow server` on loopback (started with the module, so that it boots while the
    first tests run), stopped with its workers at the end, whatever happened."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "w")  # noqa: SIM115 - closed below
    # The server's job runner (for GenAI evaluations) is not needed: 4 fewer processes.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination",
         str(root / "artifacts"), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield process, f"http://127.0.0.1:{port}", root / "server.log"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


@pytest.fixture(scope="module")
def tracking_uri(server):
    process, uri, log = server
    deadline = time.time() + SERVER_START_S
    while time.time() < deadline:
        assert process.poll() is None, f"mlflow server exited:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    return uri
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"mlflow server not healthy in {SERVER_START_S} s:\n{log.read_text()[-3000:]}")


def _client(uri):
    from mlflow import MlflowClient

    return MlflowClient(uri)


def test_an_unreachable_tracking_server_is_one_line_before_any_worker(tmp_path):
    closed = free_port()  # nothing listens there
    run_dir = tmp_path / "run"
    out = run_shoal_in_process("train", "--config", "examples/digits.yaml",
                               "--nproc-per-node", "2", f"run.dir={run_dir}",
                               f"trainer.metrics.mlflow.tracking_uri=http://127.0.0.1:{closed}")
    assert out.returncode == 2
    assert out.stderr == (
        f"shoal train: error: trainer.metrics.mlflow: cannot reach the MLflow tracking server "
        f"at http://127.0.0.1:{closed} (connection refused); start it, or set "
        "trainer.metrics.mlflow.tracking_uri (or MLFLOW_TRACKING_URI)\n")
    assert not run_dir.exists()  # refused before the run directory, before any worker


def test_without_the_mlflow_package_the_config_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` fails, as uninstalled
    out = run_shoal_in_process("train", "--config", "examples/digits.yaml",
                               f"run.dir={tmp_path}", "trainer.metrics.mlflow=true")
    assert out.returncode == 2
    assert out.stderr == ("shoal train: error: invalid configuration: trainer.metrics.mlflow: "
                          "MLflow logging needs the mlflow package: pip install 'shoal[mlflow]'\n")


def test_a_database_store_without_the_full_package_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # the mlflow extra's client alone
    store = f"sqlite:///{tmp_path}/mlflow.db"
    out = run_shoal_in_process("train", "--config", "examples/digits.yaml",
                               f"run.dir={tmp_path}/run",
                               f"trainer.metrics.mlflow.tracking_uri={store}")
    assert out.returncode == 2
    assert out.stderr == (
        f"shoal train: error: trainer.metrics.mlflow: MLflow tracking into the database {store} "
        "needs the full mlflow package (pip install mlflow); or set tracking_uri to a tracking "
        "server (http://host:5000)\n")


@pytest.mark.timeout(SERVER_START_S + 120)  # the server's start, then bounded requests
def test_a_server_that_stops_answering_mid_run_costs_one_line(tracking_uri, capsys):
    run = MLflowRun.start(MLflowConfig(tracking_uri=tracking_uri), {"a": {"b": 1}})
    assert run is not None
    run.log_metrics(1, {"train/loss": 0.5})
    run.flush()
    # The server goes away: requests now meet a closed port.
    run.client = _client(f"http://127.0.0.1:{free_port()}")
    for step in (2, 3):
        run.log_metrics(step, {"train/loss": 0.4})
        run.flush()
    run.end()
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"shoal: MLflow run {run.run_id} ({tracking_uri}/#/experiments/0/runs/" \
        f"{run.run_id})"
    assert err[1:] == [f"shoal: MLflow: logging to run {run.run_id} failed (connection "
                       "refused); training goes on, MLflow logging stops"]
    logged = _client(tracking_uri).get_run(run.run_id)
    assert logged.data.params == {"a.b": "1"} and logged.data.metrics == {"train/loss": 0.5}


@pytest.fixture(scope="module")
def killed_and_resumed(tracking_uri, tmp_path_factory):
    """Digits on 2 processes, checkpointed every step, SIGKILLed once a checkpoint of step
    KILL_AFTER or later is committed; then resumed to the end (`trainer.resume: auto`),
    saving less often."""
    run_dir = tmp_path_factory.mktemp("digits") / "run"
    args = ["train", "--config", "examples/digits.yaml", "--nproc-per-node", "2",
            f"run.dir={run_dir}", f"trainer.epochs={EPOCHS}", "trainer.metrics.every=10",
            f"trainer.checkpoint_dir={run_dir}/checkpoints", "trainer.resume=auto",
            f"trainer.metrics.mlflow.tracking_uri={tracking_uri}",
            "trainer.metrics.mlflow.experiment=digits"]
    err_file = run_dir.parent / "first.err"
    with open(err_file, "w") as err:  # a file: a pipe nobody reads could fill and block it
        first = subprocess.Popen([sys.executable, "-m", "shoal", *args,
                                  "trainer.checkpoint_every=1"], cwd=REPO,
                                 stdout=subprocess.DEVNULL, stderr=err,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})

    store = CheckpointStore(run_dir / "checkpoints")

    def committed() -> bool:
        """A checkpoint of step KILL_AFTER or later is committed. (Not step KILL_AFTER's
        alone: it is pruned three saves later, which a poll on a loaded machine may miss,
        and the workers go on for a few steps after their launcher is killed.)"""
        latest = store.latest(report=False)
        return latest is not None and int(STEP_DIR.match(latest.name)[1]) >= KILL_AFTER

    deadline = time.time() + FIRST_RUN_S
    while not (seen := committed()) and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=KILLED_GONE_S)
    first_err = err_file.read_text()
    assert first.returncode == -signal.SIGKILL and seen, first_err[-3000:]
    first_config = yaml.safe_load((run_dir / "config.yaml").read_text())
    deadline = time.time() + KILLED_GONE_S
    while processes_with(str(run_dir)) and time.time() < deadline:
        time.sleep(0.2)
    second = run_shoal(*args, "trainer.checkpoint_every=50", timeout=RESUME_S)
    assert second.returncode == 0, second.stderr[-3000:]
    return run_dir, first_config, first_err, second


@pytest.mark.timeout(MODULE_SETUP_S)
def test_one_run_from_rank_0_with_params_steps_and_artifacts(killed_and_resumed, tracking_uri):
    run_dir, first_config, first_err, second = killed_and_resumed
    client = _client(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    assert len(runs) == 1  # rank 0 only, and the resumed run continued it
    run = runs[0]
    run_id = run.info.run_id
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    # The id is said when the run opens, and kept in the checkpoints the resume read.
    assert f"[rank0]: shoal: MLflow run {run_id} (" in first_err
    assert f"[rank0]: shoal: MLflow run {run_id} continued (" in second.stderr
    assert "[rank1]: shoal: MLflow" not in first_err + second.stderr
    # Params are the resolved config of the run that opened it: as overrides, they give
    # that config back. The resume's other checkpoint interval is said, not logged.
    tree = {}
    for key, value in run.data.params.items():
        apply_override(tree, f"{key}={value}")
    assert validate_run_tree(tree, "run").model_dump(mode="json") == first_config
    assert run.data.params["trainer.checkpoint_every"] == "1"
    assert ("keeps the params it started with; changed since: trainer.checkpoint_every "
            "(1 -> 50)") in second.stderr
    # Every step's loss once, the steps of the killed run and of the resumed one: a step
    # logged just before the kill, inside the next save, may be logged again.
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted({m.step for m in history}) == list(range(1, STEPS + 1))
    assert STEPS <= len(history) <= STEPS + 1
    assert all(math.isfinite(m.value) for m in history)
    # Each epoch's validation once; the same may happen to the validation of an epoch
    # whose last step's checkpoint the resume reads (when the kill came after it).
    validations = client.get_metric_history(run_id, "val_accuracy")
    assert sorted({m.step for m in validations}) == [
        STEPS_PER_EPOCH * (epoch + 1) for epoch in range(EPOCHS)]
    assert EPOCHS <= len(validations) <= EPOCHS + 1
    # The end-of-run table and the final metrics, as the run directory has them.
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"metrics.json", "summary.txt"} <= artifacts
    final = json.loads(Path(client.download_artifacts(run_id, "metrics.json",
                                                      str(run_dir.parent))).read_text())
    assert final == json.loads((run_dir / "metrics.json").read_text())
    assert final["global_step"] == STEPS
    table = Path(client.download_artifacts(run_id, "summary.txt", str(run_dir.parent)))
    assert table.read_text().startswith("shoal: time per step by rank over ")
    assert "[rank0]: " + table.read_text().splitlines()[1] in second.stdout
