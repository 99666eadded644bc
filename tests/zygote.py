"""A server that starts `python -m shoal ARGS` for the tests by forking, not as a new
interpreter: it has imported what the command imports from torch once, so each start costs
a fork and shoal's own imports instead of importing torch again (about 1.3 s of CPU each,
on a suite that starts over a hundred commands).

``python -m tests.zygote SOCKET``: prints ``ready`` once it listens on the Unix socket
SOCKET and serves until its stdin closes (the test process ended). Each connection asks for
one command: a JSON request ``{"argv", "cwd", "env"}`` with the command's stdin, stdout and
stderr passed as file descriptors; the server answers the child's pid, then its exit status
(as ``subprocess`` reports it: negative for a signal) when it ends.

The child is what ``python -m shoal ARGS`` would be, as far as shoal can tell: the given
working directory, environment (PYTHONPATH included) and standard streams, default signal
handlers, ``sys.argv``, ``__main__`` run by runpy, exit handlers run at the end. What it
cannot be: settings that torch reads once when it is imported keep the server's values, and
``ps`` shows the server's command line. Tests that depend on either start the command
themselves (tests.helpers.run_shoal(..., fork=False)).

The client side: ``start(argv, cwd, env)`` gives a ``Forked`` command, used as a
``subprocess.Popen`` of ``python -m shoal ARGV``; the server is started once per test
process, on first use.
"""

from __future__ import annotations

import array
import atexit
import io
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# What `python -m shoal` imports of torch before anything of shoal's own (whose modules are
# imported fresh in each child, with the child's environment).
PRELOAD = ("torch", "torch.distributed.elastic.agent.server.local_elastic_agent",
           "torch.distributed.launcher.api", "torch.distributed.elastic.multiprocessing",
           "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend", "pydantic", "yaml",
           "numpy")


def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become ``python -m shoal ARGV``; never returns."""
    code = 1
    try:
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
                       signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.set_wakeup_fd(-1)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = [os.path.abspath(p) for p in extra]
        sys.path[0] = request["cwd"]  # `python -m`: the working directory first
        unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                      line_buffering=os.isatty(1), write_through=unbuffered)
        sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                      errors="backslashreplace", line_buffering=True)
        sys.argv = ["shoal", *request["argv"]]
        import atexit
        import runpy
        import traceback

        try:
            runpy.run_module("shoal", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _status(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve(path: str) -> None:
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    waiting: dict[int, socket.socket] = {}  # child pid: the connection that asked for it
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "stdin":
                if not sys.stdin.buffer.read1(512):
                    return  # the test process has ended
            elif key.data == "accept":
                conn, _ = listener.accept()
                fds = array.array("i")
                msg, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
                for level, kind, data in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for other in waiting.values():
                        other.close()
                    conn.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    _run_child(json.loads(msg), list(fds))
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                waiting[pid] = conn
            else:
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            while waiting:  # reap whatever has ended
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = waiting.pop(pid, None)
                if conn is not None:
                    try:
                        conn.sendall(f"{_status(status)}\n".encode())
                    except OSError:
                        pass
                    conn.close()


class Forked:
    """A command forked by the server, used as a ``subprocess.Popen`` of it: ``pid``,
    ``stdout`` (and ``stderr``, unless it goes to stdout) as unbuffered pipes, ``poll``,
    ``wait``, ``communicate``, ``send_signal``, ``terminate``, ``kill``, ``returncode``."""

    def __init__(self, server: str, argv: list[str], cwd: str, env: dict,
                 stderr_to_stdout: bool = False, text: bool = False):
        self.args = [sys.executable, "-m", "shoal", *argv]
        self.text, self.returncode = text, None
        out_r, out_w = os.pipe()
        err_r, err_w = (None, out_w) if stderr_to_stdout else os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(server)
            request = json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode()
            socket.send_fds(self._conn, [request], [null, out_w, err_w])
        finally:
            for fd in {null, out_w, err_w}:
                os.close(fd)
        def pipe(fd: int) -> Any:
            return (open(fd, encoding="utf-8", errors="replace") if text
                    else open(fd, "rb", buffering=0))
        self.stdout = pipe(out_r)
        self.stderr = None if err_r is None else pipe(err_r)
        self._replies = b""
        self.pid = int(self._reply(None))
        self._read: dict[Any, Any] = {}  # a pipe: all that was left in it
        self._readers: dict[Any, threading.Thread] = {}

    def _reply(self, timeout: float | None) -> bytes | None:
        """The server's next line (the pid, then the exit status); None if it has not come
        within ``timeout`` seconds."""
        self._conn.settimeout(timeout)
        try:
            while b"\n" not in self._replies:
                data = self._conn.recv(64)
                if not data:
                    raise RuntimeError("the test zygote ended without an exit status")
                self._replies += data
        except (TimeoutError, BlockingIOError):
            return None
        line, self._replies = self._replies.split(b"\n", 1)
        return line

    def _settle(self, timeout: float | None) -> bool:
        """Whether the exit status is known, waiting up to ``timeout`` seconds for it."""
        if self.returncode is None:
            status = self._reply(timeout)
            if status is None:
                return False
            self.returncode = int(status)
            self._conn.close()
        return True

    def poll(self) -> int | None:
        self._settle(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._settle(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple:
        """Everything left in the pipes, up to their end, then the exit status, as
        ``subprocess.Popen.communicate``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pipes = [p for p in (self.stdout, self.stderr) if p is not None]
        for pipe in pipes:
            if pipe not in self._readers and not pipe.closed:
                reader = threading.Thread(target=lambda p=pipe: self._read.__setitem__(
                    p, p.read()), daemon=True)
                reader.start()
                self._readers[pipe] = reader
        for reader in self._readers.values():
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.01))
        for pipe in pipes:
            pipe.close()
        empty = "" if self.text else b""
        return tuple(None if p is None else self._read.get(p, empty)
                     for p in (self.stdout, self.stderr))


class _Server:
    """This test process's server: started on first use, killed at its exit."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="shoal-zygote-")
        self.path = os.path.join(self.dir, "socket")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", self.path],
            cwd=Path(__file__).parent.parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert self.process.stdout is not None
        ready = self.process.stdout.readline()
        assert ready == b"ready\n", f"the test zygote did not start: {ready!r}"
        atexit.register(self.close)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_servers: dict[int, _Server] = {}
_lock = threading.Lock()


def start(argv: list[str], cwd: str, env: dict, stderr_to_stdout: bool = False,
          text: bool = False) -> Forked:
    """``python -m shoal ARGV`` forked by this test process's server."""
    with _lock:  # tests start commands from threads too
        if os.getpid() not in _servers:
            _servers[os.getpid()] = _Server()
        server = _servers[os.getpid()].path
    return Forked(server, argv, cwd, env, stderr_to_stdout, text)


def available() -> bool:
    """Whether commands are forked (Linux, unless SHOAL_TEST_FORK=0)."""
    return sys.platform == "linux" and os.environ.get("SHOAL_TEST_FORK") != "0"


if __name__ == "__main__":
    serve(sys.argv[1])
