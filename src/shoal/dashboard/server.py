"""The dashboard's server: a page, its scripts, and one stream of every run's new points.

One poller reads each run directory's new lines (a stat per run per interval while
nothing changes), checks the alerts, and hands each change to every open page. A page's
stream begins with everything known so far, so nothing falls between a first load and
its updates. Read-only; only the package's own page files and what lies under the run
directories given are ever served; an optional token guards the page and every run's
data, and only requests that name the server by one of its own names are answered
(hosts.py). Whatever a run directory holds, the poller goes on: a line it cannot use is a
bad line (records.py), and an error it did not foresee is said once and polling goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import mimetypes
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from shoal.dashboard.alerts import AlertSettings, check
from shoal.dashboard.guard import Guard
from shoal.dashboard.hosts import HostRule
from shoal.dashboard.run import RunWatch

if TYPE_CHECKING:
    import threading

STATIC = Path(__file__).parent / "static"
PAGE_FILES = ("index.html", "dashboard.js", "dashboard.css", "uPlot.iife.min.js",
              "uPlot.min.css", "uPlot.LICENSE")
KEEPALIVE_S = 15.0
MAX_BEHIND = 200  # changes waiting for one page (100 s of polls) before it starts anew
SHOWN_AS_IS = ("application/json", "image/png", "image/jpeg")  # a run's other files: text
NEEDS_TOKEN = """<!doctype html><meta charset="utf-8"><link rel="icon" href="data:,">
<title>shoal dashboard: token needed</title>
<h1>This dashboard needs its token</h1>
<p>Open the address that <code>shoal dashboard</code> (or <code>shoal train --dashboard</code>)
printed when it started: it ends in <code>?token=...</code>. The token is also the first line
of the <code>--token-file</code> given, or <code>$SHOAL_DASHBOARD_TOKEN</code>.</p>
"""


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
        self.failures: set[str] = set()  # unforeseen errors said already
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs

    def poll(self) -> list[dict]:
        """Read every run's new lines, check alerts; the changes, one per run that changed."""
        changes = []
        for run in self.runs:
            try:
                change = self._poll(run)
            except Exception as exc:  # noqa: BLE001 - one run's trouble stops no poll
                self._failed(run.name, exc)
                continue
            if change:
                changes.append({"run": run.index, **change})
        return changes

    def _poll(self, run: RunWatch) -> dict:
        change = run.poll() or {}
        alerts = check(run, self.settings)
        for key in alerts.keys() - self.alerts[run.index].keys():
            self.say(alerts[key])
        if alerts != self.alerts[run.index]:
            self.alerts[run.index] = alerts
            change["alerts"] = alerts
        return change

    def _failed(self, where: str, exc: Exception) -> None:
        """Said once per place and kind (a poll every half second would say it twice a
        second)."""
        key = f"{where}: {type(exc).__name__}"
        if key not in self.failures:
            self.failures.add(key)
            # What a line holds may reach the message: no control character reaches the
            # terminal.
            self.say(f"{key} while reading: {ascii(str(exc)[:200])[1:-1]} (said once; "
                     "polling goes on)")

    def close(self) -> None:
        """Tell every open page that the server stops (from any thread): the files are read
        once more first, so that a page gets the last lines the run wrote (its end, written
        moments before `shoal train --dashboard` stops the server) before its stream ends
        with a 'closed' event, and the page does not wait for it to come back."""
        if self.loop is None:
            return

        def last_read_then_close() -> None:  # on the loop, as every poll is
            changes = self.poll()
            for queue in list(self.listeners):
                if changes:
                    _hand(queue, changes)
                queue.put_nowait(None)

        with contextlib.suppress(RuntimeError):  # the loop closed already
            self.loop.call_soon_threadsafe(last_read_then_close)

    def snapshot(self) -> dict:
        return {"runs": [{**run.snapshot(), "alerts": self.alerts[run.index]}
                         for run in self.runs]}

    async def run_forever(self, interval: float) -> None:
        while True:
            try:
                changes = self.poll()
                for queue in self.listeners if changes else ():
                    _hand(queue, changes)
            except Exception as exc:  # noqa: BLE001 - the poller is the pages' only source
                self._failed("the runs", exc)
            await asyncio.sleep(interval)


def _hand(queue: asyncio.Queue, changes: list[dict]) -> None:
    """Give a page its changes; a page that fell far behind (it does not read its stream)
    gets everything anew instead of a queue that grows without end."""
    if queue.qsize() >= MAX_BEHIND:
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait("snapshot")
    else:
        queue.put_nowait(changes)


def _to_terminal(message: str) -> None:
    print(f"shoal dashboard: {message}", file=sys.stderr, flush=True)


def create_app(directories: list[str | Path], token: str | None = None,
               interval: float = 0.5, settings: AlertSettings | None = None,
               say: Callable[[str], None] | None = None,
               hosts: HostRule | None = None) -> Starlette:
    """The dashboard of ``directories``; ``token``: what every request for the page or a
    run's data must carry (as ``Authorization: Bearer ...`` or ``?token=...``); ``hosts``:
    the ``Host`` headers answered (default: a server on 127.0.0.1's)."""
    hub = Hub(directories, settings, say)
    hub.poll()  # what is there already is read before the first page asks

    @contextlib.asynccontextmanager
    async def lifespan(app):
        hub.loop = asyncio.get_running_loop()
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
        if not allowed(request):  # say so here: the page alone could not tell why
            return HTMLResponse(NEEDS_TOKEN, 401, headers={"Cache-Control": "no-store"})
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in PAGE_FILES:
            return PlainTextResponse("not found", 404)
        kind = "text/plain" if name.endswith("LICENSE") else mimetypes.guess_type(name)[0]
        return FileResponse(STATIC / name, media_type=kind)

    async def snapshot(request: Request) -> Response:
        return Response(_json(hub.snapshot()), media_type="application/json")

    async def events(request: Request) -> Response:
        queue: asyncio.Queue = asyncio.Queue()
        hub.listeners.add(queue)

        def everything() -> str:
            """All there is now; the changes waiting in the queue are in it already (the
            poller runs on this loop: nothing changes between the two)."""
            closing = False
            while not queue.empty():
                closing |= queue.get_nowait() is None
            if closing:
                queue.put_nowait(None)
            return _event("snapshot", hub.snapshot())

        async def stream():
            try:
                yield everything()
                while True:
                    try:
                        changes = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                    except asyncio.TimeoutError:
                        yield ": keepalive\n\n"
                        continue
                    if changes is None:  # the server stops
                        yield _event("closed", {})
                        return
                    if changes == "snapshot":  # fell behind: start again from all there is
                        yield everything()
                        continue
                    yield _event("changes", changes)
            finally:
                hub.listeners.discard(queue)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store",
                                          "X-Accel-Buffering": "no"})

    async def run_file(request: Request) -> Response:
        """A file of a run directory (its resolved config, its summary), shown as text."""
        index = request.path_params["run"]
        if not 0 <= index < len(hub.runs):
            return PlainTextResponse("no such run", 404)
        try:  # a NUL byte or a name too long is no file either
            root = hub.runs[index].dir.resolve()
            target = (root / request.path_params["path"]).resolve()
            found = (target.is_relative_to(root) and target.is_file()
                     and os.access(target, os.R_OK))
        except (ValueError, OSError):
            found = False
        if not found:
            return PlainTextResponse("not found", 404)
        kind = mimetypes.guess_type(target.name)[0]
        return FileResponse(target, media_type=kind if kind in SHOWN_AS_IS else "text/plain",
                            headers={"Content-Security-Policy": "sandbox"})

    # The page's scripts hold no run data (they are the package's own files): the token
    # guards the data, which the page asks for with the token of its own address.
    routes = [Route("/", page), Route("/static/{name}", static),
              Route("/api/snapshot", guarded(snapshot)), Route("/api/events", guarded(events)),
              Route("/api/runs/{run:int}/files/{path:path}", guarded(run_file))]
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(Guard, rule=hosts or HostRule())])
    app.state.hub = hub
    return app


def _json(data) -> str:
    # ASCII: a lone surrogate a line may hold (JSON allows "\ud800") is sent escaped.
    return json.dumps(data, separators=(",", ":"), allow_nan=False)


def _event(name: str, data) -> str:
    return f"event: {name}\ndata: {_json(data)}\n\n"


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
        self.hub: Hub = app.state.hub
        self.thread: threading.Thread | None = None

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
        self.hub.close()
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
