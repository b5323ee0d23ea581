"""The service as the tests start it: the line `retrieve.py --serve` prints once it is ready, and the URL in it;
`Service`, the command in a process group of its own."""

import os
import re
import signal
import subprocess
import time

import command_server
from repo import ROOT

READY = "; ready"  # how the command's ready line ends: "... at http://HOST:PORT: loaded ...; ready"


def ready_url(line: str) -> str:
    """The URL a ready line names."""
    return re.search(r" at (http://\S+): loaded", line).group(1)


def wait_ready(proc: subprocess.Popen, log: list[str], seconds: float) -> str:
    """Reads the server's stderr into `log` until its ready line; returns the URL it serves at. AssertionError with
    the log's tail when the server exits first or says nothing ready within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"server exited {proc.wait()}: {''.join(log)[-3000:]}")
        log.append(line)
        if line.rstrip().endswith(READY):
            return ready_url(line)
    raise AssertionError(f"server not ready in {seconds} s: {''.join(log)[-3000:]}")


class Service:
    """`retrieve.py --index W --serve --port 0 ...` leading a process group of its own; `url` once it is ready."""

    def __init__(self, workdir, *flags, env=None, ready_s=400):
        self.proc = command_server.popen(["retrieve.py", "--index", str(workdir), "--serve", "--port", "0", *flags],
                                         {**os.environ, **(env or {})}, ROOT, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.log: list[str] = []
        try:
            self.url = wait_ready(self.proc, self.log, ready_s)
        except AssertionError:
            self.stop()
            raise

    def stop(self, timeout=120) -> str:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server and its workers (a Ray it started: its head too)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            _, err = self.proc.communicate()
        return "".join(self.log) + err
