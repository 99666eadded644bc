"""The dashboard's server: a page, its scripts, and one stream of every run's new points.

One poller reads each run directory's new lines (a stat per run per interval while
nothing changes), checks the alerts, and hands each change to every open page. A page's
stream begins with everything known so far, so nothing falls between a first load and
its updates. Read-only; only the package's own page files and what lies under the run
directories given are ever served; an optional token guards every run's data.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import mimetypes
import sys
from collections.abc import Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from shoal.dashboard.alerts import AlertSettings, check
from shoal.dashboard.run import RunWatch

STATIC = Path(__file__).parent / "static"
PAGE_FILES = ("index.html", "dashboard.js", "dashboard.css", "uPlot.iife.min.js",
              "uPlot.min.css", "uPlot.LICENSE")
KEEPALIVE_S = 15.0


class Hub:
    """Every run being watched, and the pages listening for their changes."""

    def __init__(self, directories: list[str | Path], settings: AlertSettings | None = None,
                 say: Callable[[str], None] | None = None):
        self.runs = [RunWatch(d, i) for i, d in enumerate(directories)]
        names = [run.name for run in self.runs]
        for run in self.runs:  # runs/a/digits and runs/b/digits: a/digits and b/digits
            if names.count(run.name) > 1:
                run.name = f"{run.dir.resolve().parent.name}/{run.name}"
        self.settings = settings or AlertSettings()
        self.alerts: dict[int, dict[str, str]] = {run.index: {} for run in self.runs}
        self.say = say if say is not None else _to_terminal
        self.listeners: set[asyncio.Queue] = set()

    def poll(self) -> list[dict]:
        """Read every run's new lines, check alerts; the changes, one per run that changed."""
        changes = []
        for run in self.runs:
            change = run.poll() or {}
            alerts = check(run, self.settings)
            for key in alerts.keys() - self.alerts[run.index].keys():
                self.say(alerts[key])
            if alerts != self.alerts[run.index]:
                self.alerts[run.index] = alerts
                change["alerts"] = alerts
            if change:
                changes.append({"run": run.index, **change})
        return changes

    def snapshot(self) -> dict:
        return {"runs": [{**run.snapshot(), "alerts": self.alerts[run.index]}
                         for run in self.runs]}

    async def run_forever(self, interval: float) -> None:
        while True:
            changes = self.poll()
            if changes:
                for queue in self.listeners:
                    queue.put_nowait(changes)
            await asyncio.sleep(interval)


def _to_terminal(message: str) -> None:
    print(f"shoal dashboard: {message}", file=sys.stderr, flush=True)


def create_app(directories: list[str | Path], token: str | None = None,
               interval: float = 0.5, settings: AlertSettings | None = None,
               say: Callable[[str], None] | None = None) -> Starlette:
    """The dashboard of ``directories``; ``token``: what every request must carry (as
    ``Authorization: Bearer ...`` or ``?token=...``)."""
    hub = Hub(directories, settings, say)
    hub.poll()  # what is there already is read before the first page asks

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(hub.run_forever(interval))
        try:
            yield
        finally:
            task.cancel()

    def allowed(request: Request) -> bool:
        if token is None:
            return True
        given = request.query_params.get("token", "")
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            given = header[7:]
        return hmac.compare_digest(given.encode(), token.encode())

    def guarded(handler):
        async def endpoint(request: Request) -> Response:
            if not allowed(request):
                return PlainTextResponse("shoal dashboard: a valid token is needed "
                                         "(?token=... or Authorization: Bearer ...)", 401)
            return await handler(request)
        return endpoint

    async def page(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in PAGE_FILES:
            return PlainTextResponse("not found", 404)
        kind = "text/plain" if name.endswith("LICENSE") else mimetypes.guess_type(name)[0]
        return FileResponse(STATIC / name, media_type=kind)

    async def snapshot(request: Request) -> Response:
        return JSONResponse(hub.snapshot())

    async def events(request: Request) -> Response:
        queue: asyncio.Queue = asyncio.Queue()
        hub.listeners.add(queue)

        async def stream():
            try:
                yield _event("snapshot", hub.snapshot())
                while True:
                    try:
                        changes = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                    except asyncio.TimeoutError:
                        yield ": keepalive\n\n"
                        continue
                    yield _event("changes", changes)
            finally:
                hub.listeners.discard(queue)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store",
                                          "X-Accel-Buffering": "no"})

    async def run_file(request: Request) -> Response:
        """A file of a run directory (its resolved config, its summary)."""
        index = request.path_params["run"]
        if not 0 <= index < len(hub.runs):
            return PlainTextResponse("no such run", 404)
        root = hub.runs[index].dir.resolve()
        target = (root / request.path_params["path"]).resolve()
        if not target.is_relative_to(root) or not target.is_file():
            return PlainTextResponse("not found", 404)
        return FileResponse(target)

    # The page and its scripts hold no run data (they are the package's own files): the
    # token guards the data, which the page asks for with the token of its own address.
    routes = [Route("/", page), Route("/static/{name}", static),
              Route("/api/snapshot", guarded(snapshot)), Route("/api/events", guarded(events)),
              Route("/api/runs/{run:int}/files/{path:path}", guarded(run_file))]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.hub = hub
    return app


def _event(name: str, data) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def url_of(host: str, port: int, token: str | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else shown
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


class Server:
    """uvicorn serving ``app``, in the foreground or on a thread of its own."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 8000):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                    log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=1))
        self.host = host
        self.thread = None

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    def run(self) -> None:
        self.server.run()

    def start(self) -> Server:
        """Serve on a background thread; returns once the socket listens."""
        import threading
        import time

        self.thread = threading.Thread(target=self.server.run, name="shoal-dashboard",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the dashboard could not listen on {self.host}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
