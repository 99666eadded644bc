"""MLflow beside TensorBoard: rank 0's run on an MLflow tracking server.

The one module that meets MLflow. Rank 0 opens the run when training starts (a new one, or
the one a resumed checkpoint or the config names), logs the resolved run config as params
(flattened keys: ``trainer.batch_size``), each metrics window's figures in one request, and
at the end the summary table and the final metrics as artifacts. Requests go out from a
thread of their own, so training never waits for the tracking server, and each is bounded
(``timeout``, few retries): a server that cannot be reached is one line before the start,
and one that stops answering mid-run is one line and the end of MLflow logging, never the
end of the run.
"""

from __future__ import annotations

import contextlib
import getpass
import importlib.util
import json
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shoal.errors import UsageError
from shoal.extras import install_line

INSTALL = install_line("mlflow")
# MLflow's limits of one log_batch request and of a param's value.
_BATCH_METRICS, _BATCH_PARAMS, _PARAM_LENGTH = 1000, 100, 6000
_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's SQL stores


class MLflowConfig(BaseModel):
    """Where rank 0 logs the run in MLflow (the ``trainer.metrics.mlflow`` section)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    tracking_uri: str | None = None
    """The tracking server (http://host:5000), a database (sqlite:///mlflow.db) or a
    directory; default: $MLFLOW_TRACKING_URI, else MLflow's default (./mlflow.db)."""
    experiment: str | None = None
    """Experiment of the run, created if missing; default: $MLFLOW_EXPERIMENT_NAME, else
    MLflow's 'Default'."""
    run_name: str | None = None
    """Name of a new run; default: the run directory's name (shoal train)."""
    run_id: str | None = None
    """Log into this existing run; default: the run a resumed checkpoint logged to, else a
    new run."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Tags of a new run."""
    timeout: float = Field(5.0, gt=0)
    """Seconds a request to the tracking server may take. The check before training tries
    once; a request during training is tried 3 times before MLflow logging stops."""

    @model_validator(mode="after")
    def _installed(self) -> MLflowConfig:
        # Said when the config is read, on every rank alike, not by rank 0 alone mid-start.
        if importlib.util.find_spec("mlflow") is None:
            raise ValueError(f"MLflow logging needs the mlflow package: {INSTALL}")
        return self


@contextlib.contextmanager
def _bounded(config: MLflowConfig, retries: int) -> Iterator[None]:
    """MLflow's HTTP client retries for minutes by default; within this block a request
    takes ``config.timeout`` seconds and ``retries`` retries at most. MLflow reads these
    settings from the environment at each request; a user's own setting is kept."""
    settings = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, math.ceil(config.timeout))),
                "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(retries),
                "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
    added = [name for name in settings if name not in os.environ]
    os.environ.update({name: settings[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _client(config: MLflowConfig) -> Any:
    try:
        import mlflow
    except ImportError:
        raise UsageError(f"MLflow logging needs the mlflow package: {INSTALL}") from None
    uri = config.tracking_uri or mlflow.get_tracking_uri()
    if uri.split(":", 1)[0].split("+")[0] in _DATABASES and \
            importlib.util.find_spec("sqlalchemy") is None:
        # The extra installs MLflow's client (mlflow-skinny), which talks to a server.
        raise UsageError(f"MLflow tracking into the database {uri} needs the full mlflow "
                         "package (pip install mlflow); or set tracking_uri to a tracking "
                         "server (http://host:5000)")
    return mlflow.MlflowClient(tracking_uri=uri)


def _reason(exc: BaseException) -> str:
    """An MLflow error in a few words: its last line, without the URL noise of urllib3."""
    text = " ".join(str(exc).split())
    for known in ("Connection refused", "Name or service not known", "timed out",
                  "No route to host", "RESOURCE_DOES_NOT_EXIST"):
        if known in text:
            return known.lower().replace("_", " ")
    return text[:200]


def check_tracking(config: MLflowConfig, section: str = "metrics.mlflow") -> str:
    """Before any worker starts: the tracking server answers and a named run exists.
    Returns the line to print; raises a one-line UsageError naming ``section``."""
    try:
        client = _client(config)
    except UsageError as exc:
        raise UsageError(f"{section}: {exc}") from None
    uri = client.tracking_uri
    with _bounded(config, retries=0):
        try:
            client.search_experiments(max_results=1)
        except Exception as exc:  # noqa: BLE001 - any failure of the store, in one line
            raise UsageError(f"{section}: cannot reach the MLflow tracking server at {uri} "
                             f"({_reason(exc)}); start it, or set {section}.tracking_uri "
                             "(or MLFLOW_TRACKING_URI)") from None
        if config.run_id is not None:
            try:
                client.get_run(config.run_id)
            except Exception as exc:  # noqa: BLE001
                raise UsageError(f"{section}.run_id {config.run_id}: no such run at "
                                 f"{uri} ({_reason(exc)})") from None
    return f"MLflow: logging to {uri}"


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """Nested settings as MLflow params: ``a.b.c`` keys (as in ``shoal train``'s
    overrides) and values written so that ``key=value`` is an override giving them back
    (strings as they are, the rest as JSON: 32, true, null, [1, 2])."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = (value if isinstance(value, str) else json.dumps(value))[:_PARAM_LENGTH]
    return flat


def _say(message: str) -> None:
    print(f"shoal: {message}", file=sys.stderr, flush=True)


def status_of(exc: BaseException | None) -> str:
    """How a run ends, by the exception leaving it: none, an exit (preemption's 128 +
    signal) or an interrupt, any other error."""
    if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
        return "FINISHED"
    return "KILLED" if isinstance(exc, (SystemExit, KeyboardInterrupt)) else "FAILED"


class MLflowRun:
    """Rank 0's MLflow run: opened by ``start``, fed every metrics window, ended once."""

    def __init__(self, client: Any, config: MLflowConfig, run_id: str):
        self.client, self.config, self.run_id = client, config, run_id
        self._pending: list[Any] = []  # metrics of the window, sent by flush
        self._failed = False
        # Requests in order, sent by one thread: a slow server never holds up a step.
        self._requests: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_all, name="shoal-mlflow",
                                        daemon=True)
        self._sender.start()

    @classmethod
    def start(cls, config: MLflowConfig, params: dict, run_name: str | None = None,
              resume_id: str | None = None) -> MLflowRun | None:
        """A new run with ``params``, or the run ``config.run_id`` or ``resume_id`` names,
        continued. None (and one line) when the tracking server cannot be reached."""
        client = _client(config)
        run_id = config.run_id or resume_id
        with _bounded(config, retries=2):
            try:
                if run_id is None:
                    run = cls._create(client, config, run_name)
                else:
                    run = client.get_run(run_id)
                    client.update_run(run_id, status="RUNNING")
            except Exception as exc:  # noqa: BLE001 - the run trains on without MLflow
                _say(f"MLflow: cannot {'open run ' + run_id if run_id else 'create a run'} "
                     f"at {client.tracking_uri} ({_reason(exc)}); training goes on without "
                     "MLflow")
                return None
        tracked = cls(client, config, run.info.run_id)
        tracked._log_params(flatten(params), {} if run_id is None else run.data.params)
        where = client.tracking_uri.rstrip("/")
        link = (f" ({where}/#/experiments/{run.info.experiment_id}/runs/{tracked.run_id})"
                if where.startswith(("http://", "https://")) else f" at {where}")
        _say(f"MLflow run {tracked.run_id}{' continued' if run_id else ''}{link}")
        return tracked

    @staticmethod
    def _create(client: Any, config: MLflowConfig, run_name: str | None) -> Any:
        name = config.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        experiment_id = "0"  # MLflow's 'Default'
        if name:
            found = client.get_experiment_by_name(name)
            experiment_id = found.experiment_id if found else client.create_experiment(name)
        tags = {"mlflow.user": getpass.getuser(), "mlflow.source.name": "shoal",
                **config.tags}
        return client.create_run(experiment_id, tags=tags, run_name=config.run_name or run_name)

    def _log_params(self, params: dict[str, str], logged: dict[str, str]) -> None:
        """MLflow keeps a run's first params: a continued run adds the new keys and says
        which values changed."""
        from mlflow.entities import Param

        changed = [k for k in params if k in logged and logged[k] != params[k]]
        if changed:
            shown = ", ".join(f"{k} ({logged[k]} -> {params[k]})" for k in changed[:5])
            _say(f"MLflow run {self.run_id} keeps the params it started with; changed since: "
                 f"{shown}{' and more' if len(changed) > 5 else ''}")
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), _BATCH_PARAMS):
            self._send(params=new[i:i + _BATCH_PARAMS])

    def log_metrics(self, step: int, values: dict[str, float | None]) -> None:
        """Kept for the next ``flush``; None and non-finite values are left out."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending += [Metric(key, float(value), now, step) for key, value in values.items()
                          if value is not None and math.isfinite(value)]

    def flush(self) -> None:
        """The pending metrics, in as few requests as MLflow allows."""
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), _BATCH_METRICS):
            self._send(metrics=pending[i:i + _BATCH_METRICS])

    def log_text(self, text: str, name: str) -> None:
        self._call(self.client.log_text, self.run_id, text, name)

    def log_dict(self, data: dict, name: str) -> None:
        self._call(self.client.log_dict, self.run_id, data, name)

    def end(self, status: str = "FINISHED") -> None:
        """Send what is pending, mark the run FINISHED, FAILED or KILLED, and wait for the
        requests to go out (each is bounded; after a failure the rest are dropped)."""
        self.flush()
        self._call(self.client.set_terminated, self.run_id, status)
        self._requests.put(None)
        self._sender.join()

    def wait(self) -> None:
        """Until every request so far went out (or was dropped after a failure)."""
        self._requests.join()

    def _send(self, **batch: Any) -> None:
        self._call(self.client.log_batch, self.run_id, **batch)

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> None:
        self._requests.put((method, args, kwargs))

    def _send_all(self) -> None:
        """The sender thread: each request bounded; the first failure is said once and
        ends MLflow logging."""
        while (request := self._requests.get()) is not None:
            try:
                if not self._failed:
                    self._send_one(*request)
            finally:
                self._requests.task_done()
        self._requests.task_done()

    def _send_one(self, method: Any, args: tuple, kwargs: dict) -> None:
        with _bounded(self.config, retries=2):
            try:
                method(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - never the end of the training run
                self._failed = True
                _say(f"MLflow: logging to run {self.run_id} failed ({_reason(exc)}); "
                     "training goes on, MLflow logging stops")
