"""The service as the tests start it: the line `retrieve.py --serve` prints once it is ready, and the URL in it."""

import re
import subprocess
import time

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
