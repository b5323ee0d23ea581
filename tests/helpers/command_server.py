"""The repository's commands and the tests' workers run as `python SCRIPT ARGS...` would, in a child forked from a
process that has already imported what every command imports first (JAX, Flax, tensorflow-datasets, the command
modules) and what the commands that parse entities import (spaCy and its English pipeline's modules), so each test's
command does not pay the interpreter's start and those imports again: about 1.4 s of a query's 2.8 s on the suite's
2-core machine, for the few hundred commands the suite runs, and 0.6 s more where spaCy loads.

The child is a process of its own, as a fresh one is: its argv, environment, working directory, standard streams,
signals, exit status (a signal's as a negative code) and the processes it starts are its own, and its `__main__` is
the script. What it shares with the server is only the modules imported before the fork, so a request whose
environment differs from the server's in a variable read while those modules are imported (JAX_*, TF_*, PYTHON*,
...) runs as a fresh process instead.

    python tests/helpers/command_server.py SOCKET   # prints "ready" once listening; one server per pytest worker

`run` (subprocess.run's) and `popen` (subprocess.Popen's) are the tests' side (tests/helpers/repo.py's run_script
uses `run`): they start the server on first use and fall back to a fresh process wherever the server cannot serve a
command as that process would.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_PATH = list(sys.path)  # the server's own, as `python command_server.py` set it (its folder first)

# What a command's environment must share with the server's to be forked from it: variables read at import time.
IMPORT_TIME_PREFIXES = ("JAX_", "XLA_", "TF_", "PYTHON", "LD_", "OMP_", "OPENBLAS_", "MKL_", "TPU_", "CUDA",
                        "CFIR_BEIT3", "TRANSFORMERS", "HF_", "LC_", "LANG")
# The scripts forked from the server: the commands and the tests' workers (other scripts run as fresh processes).
FORKED = ("index.py", "retrieve.py", "train.py", "train_worker.py", "index_worker.py", "full_step_worker.py")


# What a child may have otherwise than the server: read at the interpreter's start, but set again by the child (its
# streams and bytecode); or read only once the command runs, after the fork: XLA_FLAGS when JAX starts its first
# backend (the device count of a multi-device test), jax.distributed's process variables when it initializes.
CHILD_SETS = ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "XLA_FLAGS", "JAX_COORDINATOR_ADDRESS",
              "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def import_time_env(environ) -> dict:
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in CHILD_SETS}


def _stdio(unbuffered: bool) -> None:
    """sys.stdout and sys.stderr over fds 1 and 2 as the interpreter makes them at its start (PYTHONUNBUFFERED: the
    bytes unbuffered and the text written through; stderr always line-buffered)."""
    import io

    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        buffer = raw if unbuffered else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(buffer, encoding=old.encoding, errors=old.errors, write_through=unbuffered,
                                  line_buffering=name == "stderr" or raw.isatty())
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _preload() -> None:
    sys.path.insert(0, str(ROOT))  # the repository's cfir_jax, as `python SCRIPT` from its root imports it
    import flax.nnx  # noqa: F401
    import jax  # noqa: F401
    import numpy  # noqa: F401
    import tensorflow_datasets  # noqa: F401

    import cfir_jax.api.index  # noqa: F401
    import cfir_jax.commands.scripts  # noqa: F401
    import cfir_jax.retrieve.pipeline  # noqa: F401
    from cfir_jax.core.errors import CfirError
    from cfir_jax.nlp.entities import load_spacy

    # spaCy and the suite's English pipeline's modules, imported as a command that parses entities imports them
    # (without PyTorch: the pipeline has no PyTorch layer); the pipeline object itself is left to each command.
    try:
        load_spacy()
    except CfirError:  # no pipeline installed: the commands that need one say so themselves
        pass


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become `python SCRIPT ARGS` and exit as it would."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if request.get("session"):  # Popen's start_new_session: the leader of a process group of its own
        os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    _stdio(bool(os.environ.get("PYTHONUNBUFFERED")))
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    os.chdir(request["cwd"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *_PATH[1:]]  # as `python SCRIPT`: its folder first
    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    code = 0
    try:
        with open(script, "rb") as f:
            exec(compile(f.read(), script, "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # What the interpreter does at its exit: wait for the threads that are not daemons, then the atexit functions.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code & 0xFF)


def _fork(listener: socket.socket, closed_in_child: tuple[int, ...]) -> tuple[int, socket.socket]:
    """Takes one request off `listener` and forks its command; (child pid, the connection its status goes to)."""
    conn, _ = listener.accept()
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        listener.close()
        conn.close()
        for fd in closed_in_child:
            os.close(fd)
        _child(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    return pid, conn


def _reap(children: dict[int, socket.socket]) -> None:
    """Sends each ended child's exit status to its connection."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:  # the test gave up on it
                pass
            conn.close()


def serve(path: str) -> None:
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    # A child's end wakes the loop: SIGCHLD writes a byte to `wake` (the handler itself does nothing).
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # pid -> the connection its status goes to
    parent = os.getppid()
    while os.getppid() == parent:  # the test process that started it is gone (checked each second): so is the server
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                pid, conn = _fork(listener, (wake_r, wake_w))
                children[pid] = conn
            else:
                while True:
                    try:
                        os.read(wake_r, 4096)
                    except BlockingIOError:
                        break
        _reap(children)


if __name__ == "__main__":
    serve(sys.argv[1])


class _Server:
    """This process's server (started on first use); None where it could not start."""

    proc: subprocess.Popen | None = None
    path: str = ""
    env: dict = {}
    failed = False


def _server() -> _Server | None:
    if _Server.failed:
        return None
    if _Server.proc is None or _Server.proc.poll() is not None:
        _Server.path = os.path.join(tempfile.mkdtemp(prefix="cfir-commands-"), "s")
        _Server.env = dict(os.environ)
        _Server.proc = subprocess.Popen([sys.executable, __file__, _Server.path], cwd=ROOT, env=_Server.env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        if _Server.proc.stdout.readline().strip() != "ready":
            _Server.proc.kill()
            _Server.failed = True
            return None
        atexit.register(_Server.proc.kill)
    return _Server


def _forkable(argv: list[str], env: dict) -> _Server | None:
    """The server to fork `python *argv` from, or None where it must be a fresh interpreter."""
    if Path(argv[0]).name not in FORKED or not hasattr(socket, "send_fds"):
        return None
    server = _server()
    return server if server is not None and import_time_env(env) == import_time_env(server.env) else None


def _stream(target, inherited: int, parent_end: list) -> int:
    """The fd a child's stream gets for Popen's `target` (None: this process's fd `inherited`; PIPE, DEVNULL or a
    file), opened here; a pipe's read end is appended to `parent_end`."""
    if target is None:
        return os.dup(inherited)
    if target == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR)
    if target == subprocess.PIPE:
        r, w = os.pipe()
        parent_end.append(r)
        return w
    return os.dup(target if isinstance(target, int) else target.fileno())


class Forked:
    """What subprocess.Popen offers for a command the server forked (pid, args, returncode, stdout, stderr, poll,
    wait, communicate, send_signal, terminate, kill): its exit status comes over the server's connection, since it is
    the server's child, not this process's."""

    def __init__(self, server: _Server, argv: list[str], env: dict, cwd, stdout, stderr, text: bool,
                 start_new_session: bool):
        self.args = [sys.executable, *argv]
        self.returncode: int | None = None
        out_end, err_end = [], []
        fds = [os.open(os.devnull, os.O_RDONLY), _stream(stdout, 1, out_end)]
        fds.append(os.dup(fds[1]) if stderr == subprocess.STDOUT else _stream(stderr, 2, err_end))
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._status = b""
        try:
            self._conn.connect(server.path)
            request = {"argv": argv, "env": dict(env), "cwd": str(cwd), "session": start_new_session}
            socket.send_fds(self._conn, [json.dumps(request).encode()], fds)
            self.pid = int(self._line())  # once forked
        except (OSError, ValueError):
            self._conn.close()
            for fd in out_end + err_end:
                os.close(fd)
            raise ServerGone from None
        finally:
            for fd in fds:
                os.close(fd)
        opened = [open(end[0], "r" if text else "rb", encoding="utf-8" if text else None,
                       errors="replace" if text else None) if end else None for end in (out_end, err_end)]
        self.stdout, self.stderr = opened
        self.stdin = None
        self._drained: dict[str, object] = {}
        self._drainers: list[threading.Thread] = []

    def _line(self, timeout: float | None = None) -> str:
        """The next line from the server ("" when it closed the connection); TimeoutError past `timeout`."""
        self._conn.settimeout(timeout)
        while b"\n" not in self._status:
            chunk = self._conn.recv(64)
            if not chunk:
                return ""
            self._status += chunk
        line, self._status = self._status.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.wait(0)
            except subprocess.TimeoutExpired:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                status = self._line(timeout)
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not status:  # the command may run on, but nobody is left to tell how it ended
                raise RuntimeError(f"the command server died while {self.args[1]} ran (pid {self.pid})")
            self.returncode = int(status)
            self._conn.close()
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None) -> tuple:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._drainers:
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if stream is not None:
                    self._drainers.append(threading.Thread(target=self._drain, args=(name, stream), daemon=True))
            for t in self._drainers:
                t.start()
        for t in self._drainers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._drained.get("stdout"), self._drained.get("stderr")

    def _drain(self, name: str, stream) -> None:
        with stream:
            self._drained[name] = stream.read()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ServerGone(Exception):
    """The server died before it forked the command: it never started."""


def popen(args, env: dict, cwd=ROOT, stdout=None, stderr=None, text: bool = False,
          start_new_session: bool = False) -> subprocess.Popen | Forked:
    """subprocess.Popen([sys.executable, *args], ...) for the tests' commands and workers: forked from the server
    where `args[0]` is one it forks and the environment allows it, else a fresh interpreter."""
    argv = [str(a) for a in args]
    server = _forkable(argv, env)
    if server is not None:
        try:
            return Forked(server, argv, env, cwd, stdout, stderr, text, start_new_session)
        except ServerGone:  # the command never started: a fresh process; the next command starts a new server
            server.proc.kill()
            server.proc = None
    return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text,
                            start_new_session=start_new_session)


def run(args, env: dict, cwd=ROOT, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python *args` with `env` in `cwd`, its output captured (subprocess.run's CompletedProcess and its
    TimeoutExpired), through `popen`."""
    proc = popen(args, env, cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()  # reaped, as subprocess.run does
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
