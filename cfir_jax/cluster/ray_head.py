"""The Ray head that `retrieve.py --serve --engine ray` starts when it joins no cluster (`cfir_jax.cluster.command`).

It lives and dies with the command. `ray start --head` runs in a session of its own, in a temp dir of its own, with
token authentication that the command sets up itself: a random 64-hex token in a 0600 file of that dir, named to the
head (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH), to this driver and, through the raylet's environment, to every
worker. Nothing is read from or written to `~/.ray`, so it starts the same on a machine where Ray was never used.

The head's processes are found by that session: the GCS server, the raylet and the agents share the `ray start`
process's group, and the workers take process groups of their own but keep its session. `stop` ends them all, and
only them (never `ray stop`, which ends every Ray of the user on the machine). `lost` names the raylet or GCS server
once it is gone (the raylet also dies with its dashboard agent, with which it fate-shares).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cfir_jax.core.errors import CfirError

TOKEN_FILE = "auth_token"
VITAL = ("raylet", "gcs_server")  # the processes (their /proc comm) without which the node is gone


def session_pids(session: int) -> list[int]:
    """The live processes (zombies left out) of a session, read from /proc: [pid, ...]. Sessions 0 and 1 (the
    kernel's threads, init's) are never a head's: refused."""
    if session <= 1:
        raise ValueError(f"session {session} is no head's")
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, session, ...
        if fields[0] != "Z" and int(fields[3]) == session:
            found.append(int(entry.name))
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] != "Z"


class RayHead:
    """A head of this command's own: `launch` it, hand `driver_env` to this process before Ray is imported, `stop`
    it in every case (the finally of whoever launched it)."""

    def __init__(self, num_cpus: int, object_store_mb: int):
        self.num_cpus, self.object_store_mb = int(num_cpus), int(object_store_mb)
        self.temp_dir = tempfile.mkdtemp(prefix="cfir-ray-")  # 0700; short: Ray's sockets live under it
        self.token_path = os.path.join(self.temp_dir, TOKEN_FILE)
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        self.port = free_port()
        self.session = 0  # the `ray start` process: the session and process group of the head's processes
        self.vital: dict[int, str] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def logs(self) -> str:
        return os.path.join(self.temp_dir, "session_latest", "logs")

    def driver_env(self) -> dict[str, str]:
        """What the head, this driver and the workers are given: token auth with this head's token file, and no task
        events. Ray records every task's events in the GCS for its dashboard and state API, which this command reads
        neither of, up to 100,000 tasks (`task_events_max_num_task_in_gcs`): each search is a few actor tasks, so the
        GCS server grew 56 -> 110 MiB over a 30-minute soak's 24,000 requests (benchmarks/RESULTS.md)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_path,
                "RAY_task_events_report_interval_ms": "0"}

    def launch(self) -> None:
        """`ray start --head`, sized to num_cpus logical CPUs; CfirError in one line if it fails."""
        env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}  # the token file is this head's only
        env.update(self.driver_env())
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = [ray_cli, "start", "--head", f"--port={self.port}", f"--num-cpus={self.num_cpus}",
               f"--temp-dir={self.temp_dir}", f"--object-store-memory={self.object_store_mb << 20}",
               "--include-dashboard=false", "--disable-usage-stats"]
        # A stop signal between the start and the record of the session would leave the head unknown: held back
        # until the session is recorded, then delivered.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    start_new_session=True)
            self.session = proc.pid
            print(f"starting a Ray head on port {self.port} with {self.num_cpus} CPUs (process group "
                  f"{self.session}, logs in {self.logs})", file=sys.stderr, flush=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        out, _ = proc.communicate()
        if proc.returncode != 0:
            last = out.strip().splitlines()[-1] if out.strip() else f"exit {proc.returncode}"
            raise CfirError(f"ray start --head failed: {last.strip()} (logs: {self.logs})")
        self.vital = {pid: _comm(pid) for pid in session_pids(self.session) if _comm(pid) in VITAL}
        missing = set(VITAL) - set(self.vital.values())
        if missing:
            raise CfirError(f"ray start --head left no {', '.join(sorted(missing))} running (logs: {self.logs})")

    def lost(self) -> str | None:
        """The first vital process of the head that is gone ('raylet (pid N)'), or None while all live."""
        for pid, name in self.vital.items():
            if not _alive(pid):
                return f"{name} (pid {pid})"
        return None

    def join_line(self, node_ip: str) -> str:
        """How another host joins this head."""
        return (f"Ray head at {node_ip}:{self.port}, token in {self.token_path}; to add a host, copy that file to "
                f"it and run: RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=FILE ray start --address={node_ip}:{self.port}")

    def stop(self, keep_logs: bool, grace_s: float = 5.0) -> None:
        """Ends every process of the head's session (SIGTERM, then SIGKILL after `grace_s`; 0: SIGKILL at once) and
        removes its temp dir (the logs kept when `keep_logs`, the token always)."""
        if self.session:
            steps = [(signal.SIGTERM, grace_s)] if grace_s > 0 else []
            for sig, wait_s in [*steps, (signal.SIGKILL, 5.0)]:
                # Every process found on each look is signalled, not only those of the first: a process forked while
                # the session was being signalled (a worker the raylet was starting, an entity worker a front was
                # replacing) was left running after the command had exited.
                signalled: set[int] = set()
                end = time.monotonic() + wait_s
                pids = session_pids(self.session)
                while pids:
                    for pid in set(pids) - signalled:
                        try:
                            os.kill(pid, sig)
                        except ProcessLookupError:
                            pass
                        signalled.add(pid)
                    if time.monotonic() >= end:
                        break
                    time.sleep(0.1)
                    pids = session_pids(self.session)
                if not pids:
                    break
        if keep_logs and self.session:  # a head never launched has no logs
            Path(self.token_path).unlink(missing_ok=True)
        else:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (IPv6 when it has a colon)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
