"""Ray's lifetime is the command's (`retrieve.py --serve --engine ray`, `cfir_jax.cluster.command`), run as an operator
runs it on a fresh machine: HOME an empty folder, no RAY_* variable, the default `serve` settings. The command starts
its own head with a token it makes; a head or a joined cluster too small is refused in one line; a start past its
deadline ends in one line; a SIGTERM while the head starts or while deploying stops it leaving no process of its Ray;
its raylet killed while serving: the command names it and exits non-zero within 30 s, leaving nothing. (SIGTERM while
serving: tests/e2e/test_serve_cluster.py.)"""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from ray_processes import clean_env, session_processes
from repo import ROOT

pytest.importorskip("ray.serve", reason="the cluster service needs Ray Serve: pip install -e '.[cluster]'")

QUIET = ["--config.retrieval.sr=exact", "--config.entity_workers.serve=0", "--config.serve.verify_mb_per_s=0"]


class Command:
    """`retrieve.py --serve --engine ray` in a session of its own, its stderr read line by line as it comes."""

    def __init__(self, workdir, env, *overrides):
        self.proc = subprocess.Popen(
            [sys.executable, "retrieve.py", "--index", str(workdir), "--serve", "--engine", "ray", "--port", "0",
             *QUIET, *overrides], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout_s: float) -> str:
        """The first line holding `text`; fails when the command exits or `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = next((line for line in list(self.lines) if text in line), None)
            if found is not None:
                return found
            assert self.proc.poll() is None or self._reader.is_alive(), \
                f"exited {self.proc.returncode} before {text!r}: {self.log[-3000:]}"
            time.sleep(0.1)
        raise AssertionError(f"no {text!r} in {timeout_s} s: {self.log[-3000:]}")

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    @property
    def head_session(self) -> int:
        """The session (and process group) of the head it started, as it printed it."""
        return int(re.search(r"process group (\d+)", self.wait_for("starting a Ray head", 1)).group(1))

    def wait(self, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._reader.join(10)
        return code

    def kill(self):
        """The test's own cleanup: the command and whatever of its Ray is left."""
        session = next((int(m.group(1)) for line in self.lines if (m := re.search(r"process group (\d+)", line))), 0)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in session_processes(session) if session else {}:
            os.kill(pid, signal.SIGKILL)


def _assert_nothing_left(session: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while session_processes(session) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not session_processes(session), session_processes(session)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A fresh machine's environment for each command (its own empty HOME)."""
    return lambda: clean_env(tmp_path_factory.mktemp("home"))


def test_a_head_too_small_is_refused_in_one_line_before_ray_starts(workdir, home):
    cmd = Command(workdir, home(), "--config.serve.head_num_cpus=2", "--config.serve.shards=2",
                  "--config.serve.shard_replicas=2", "--config.serve.front_replicas=2",
                  "--config.serve.gateway_replicas=2")
    try:
        assert cmd.wait(120) == 2, cmd.log
    finally:
        cmd.kill()
    assert cmd.lines == ["error: the application needs 2.5 CPUs (2 fronts x 0.5 + 4 shard replicas x 0.25 + "
                         "2 gateways x 0.25), the head has 2 (serve.head_num_cpus): lower serve.*_num_cpus or the "
                         "replicas, or raise serve.head_num_cpus (0: sized for the replicas)"], cmd.log


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["starting a Ray head", "deploying ("])
def test_sigterm_while_the_head_starts_or_deploys_stops_it_leaving_no_process(workdir, home, moment):
    """The SIGTERM the issue saw leak a head: at the head's start (before `ray start` returns) and at the
    deployment's (the replicas being placed); exit 0, nothing of its Ray left, its temp dir gone."""
    cmd = Command(workdir, home())
    try:
        cmd.wait_for(moment, 300)
        session = cmd.head_session
        os.kill(cmd.proc.pid, signal.SIGTERM)
        assert cmd.wait(60) == 0, cmd.log
        _assert_nothing_left(session)
    finally:
        cmd.kill()
    assert "stopped before it was ready: the Ray it started is stopped" in cmd.lines[-1], cmd.log
    temp_dir = re.search(r"logs in (\S+)/session_latest", cmd.log).group(1)
    assert not os.path.exists(temp_dir)


@pytest.mark.slow
def test_a_start_past_its_deadline_is_one_line_and_exit_2_leaving_no_process(workdir, home):
    """Never a silent wait: replicas not running by serve.ready_timeout_s (here 1 s, less than any start takes) end
    the command with one line naming each deployment's state; its Ray is stopped, its logs kept and named."""
    cmd = Command(workdir, home(), "--config.serve.ready_timeout_s=1")
    try:
        assert cmd.wait(300) == 2, cmd.log
        session = cmd.head_session
        _assert_nothing_left(session)
    finally:
        cmd.kill()
    error = cmd.lines[-1]
    # What waits: each deployment's replicas once Serve has them ("Front 0/1 running; ..."), else the application, or
    # before it the relay actor (its process not started in 1 s on a loaded machine)
    assert re.match(r"error: not ready after 1 s \(serve.ready_timeout_s\): (.*Front \d/1 running.*|the application "
                    r".+|the relay actor has not started \(.+\)) \(Ray's logs: \S+\)$", error), cmd.log
    logs = re.search(r"\(Ray's logs: (\S+)\)$", error).group(1)
    assert os.path.isdir(logs)
    shutil.rmtree(logs.split("/session_latest/")[0])


@pytest.fixture(scope="module")
def served(workdir, home):
    """The command with every default (one replica of each part), from an empty HOME, ready."""
    cmd = Command(workdir, home())
    try:
        ready = cmd.wait_for("; ready", 600)
    except BaseException:
        cmd.kill()
        raise
    cmd.url = ready.split(") at ", 1)[1].split(": loaded", 1)[0]
    yield cmd
    cmd.kill()


@pytest.mark.slow
def test_the_head_has_a_token_of_its_own_and_says_how_to_join_it(served):
    join = served.wait_for("to add a host", 1)
    token_path = re.search(r"token in (\S+);", join).group(1)
    assert os.stat(token_path).st_mode & 0o777 == 0o600
    assert re.fullmatch(r"[0-9a-f]{64}", open(token_path).read())
    assert re.search(r"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=FILE ray start --address=\S+:\d+$", join), join
    assert httpx.get(served.url + "/readyz", timeout=30).json()["ready"]


@pytest.mark.slow
def test_joining_a_cluster_too_small_is_refused_in_one_line_and_leaves_it_serving(served, workdir, home):
    """A second command joins the served head (its token, its address) asking for 3 fronts: 1.75 CPUs where 1.5 are
    free (the served head of 2 CPUs holds 1 front, its ingress and its shard: no gateway, no shard replica)."""
    join = served.wait_for("to add a host", 1)
    token_path, address = re.search(r"token in (\S+);.* --address=(\S+)$", join).groups()
    env = {**home(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path}
    cmd = Command(workdir, env, "--address", address, "--config.serve.front_replicas=3")
    try:
        assert cmd.wait(180) == 2, cmd.log
    finally:
        cmd.kill()
    errors = [line for line in cmd.lines if line.startswith("error:")]
    assert errors == [f"error: the application needs 1.75 CPUs (3 fronts x 0.5 + 1 gateway x 0.25), the cluster at "
                      f"{address} has 1.5 free: lower serve.*_num_cpus or the replicas, or add a host to the "
                      "cluster"], cmd.log
    assert httpx.get(served.url + "/readyz", timeout=30).json()["ready"]


@pytest.mark.slow
def test_the_raylet_killed_exits_non_zero_within_30_s_naming_it(served):
    """The node's raylet SIGKILLed under the service (what killing the dashboard agent does too): the command says so
    in one line and exits 2 within 30 s, so that a process manager restarts it; nothing of its Ray is left."""
    session = served.head_session
    raylet = [pid for pid, name in session_processes(session).items() if name == "raylet"]
    assert len(raylet) == 1, session_processes(session)
    os.kill(raylet[0], signal.SIGKILL)
    t0 = time.monotonic()
    code = served.wait(30)
    assert time.monotonic() - t0 < 30
    assert code == 2, served.log
    assert served.lines[-1].startswith(f"error: the Ray this command started lost its raylet (pid {raylet[0]}) "
                                       "while serving"), served.log[-2000:]
    _assert_nothing_left(session)
    logs = re.search(r"its logs: (\S+);", served.lines[-1]).group(1)
    assert os.path.isfile(os.path.join(logs, "raylet.out"))  # kept after a failure, named in the line
    shutil.rmtree(logs.split("/session_latest/")[0])
