"""The start of the cluster service without Ray (cfir_jax/cluster/sizing.py, ray_head.py): what the replicas reserve,
gateways included; the head sized for them or refused in one line naming the shortfall; a cluster without room
refused, and an address where nothing listens at once; the head's token a fresh 0600 file of its own temp dir; its
stop ending every process of its session, those that left its process group too (as Ray's workers do); a vital
process gone is named."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from cfir_jax.cluster.ray_head import RayHead, free_port, session_pids
from cfir_jax.cluster.sizing import check_reachable, check_room, head_cpus, needs
from cfir_jax.core.config_serve import serve_config
from cfir_jax.core.errors import CfirError


def _documented():
    """The documented command's settings: 2 shards x 2 replicas, 2 fronts, 2 gateways, every default else."""
    s = serve_config()
    s.update(dict(shards=2, shard_replicas=2, front_replicas=2, gateway_replicas=2))
    return s


def test_every_replica_is_counted_the_gateways_included():
    need = needs(_documented())
    assert need.cpus == pytest.approx(2.5) and need.gpus == 0
    assert need.parts == "2 fronts x 0.5 + 4 shard replicas x 0.25 + 2 gateways x 0.25"


def test_one_front_is_the_ingress_and_no_gateway_is_counted():
    s = _documented()
    s.front_replicas = 1  # deployments.build_app serves HTTP from the front itself: no gateway is placed
    need = needs(s)
    assert need.cpus == pytest.approx(1.5) and need.parts == "1 front x 0.5 + 4 shard replicas x 0.25"


def test_one_shard_is_each_fronts_own_and_no_shard_replica_is_counted():
    s = serve_config()  # the defaults: one shard, one front
    need = needs(s)
    assert need.cpus == pytest.approx(0.5) and need.parts == "1 front x 0.5"


def test_the_head_is_sized_for_every_replica_and_at_least_the_cores():
    s = _documented()
    assert head_cpus(s, needs(s), cores=2) == 3  # 2.5 CPUs reserved: the head of 2 never placed a gateway
    assert head_cpus(s, needs(s), cores=16) == 16
    s.head_num_cpus = 4
    assert head_cpus(s, needs(s), cores=2) == 4


def test_a_head_too_small_is_refused_naming_the_shortfall():
    s = _documented()
    s.head_num_cpus = 2
    with pytest.raises(CfirError, match=re.escape(
            "the application needs 2.5 CPUs (2 fronts x 0.5 + 4 shard replicas x 0.25 + 2 gateways x 0.25), the head "
            "has 2 (serve.head_num_cpus): lower serve.*_num_cpus or the replicas")):
        head_cpus(s, needs(s), cores=2)


def test_a_cluster_without_room_is_refused_in_one_line():
    need = needs(_documented())
    check_room(need, {"CPU": 2.5}, "the cluster at h:6379")  # exactly enough
    with pytest.raises(CfirError, match=r"needs 2.5 CPUs .*, the cluster at h:6379 has 2 free: lower "):
        check_room(need, {"CPU": 2.0}, "the cluster at h:6379")
    s = _documented()
    s.front_num_gpus = 1.0
    with pytest.raises(CfirError, match=r"needs 2 GPUs .* has 1 free"):
        check_room(needs(s), {"CPU": 8.0, "GPU": 1.0}, "the cluster at h:6379")


def test_joining_an_address_where_nothing_listens_is_refused_at_once():
    """Ray's driver retries such an address for minutes without a word (seen: over 5 minutes)."""
    t0 = time.monotonic()
    with pytest.raises(CfirError, match=r"cannot join the cluster at 127.0.0.1:\d+: Connection refused; is its head "):
        check_reachable(f"127.0.0.1:{free_port()}")
    assert time.monotonic() - t0 < 10
    check_reachable("auto")  # Ray resolves it


def test_the_head_token_is_a_fresh_0600_file_in_its_own_temp_dir():
    a, b = RayHead(2, 100), RayHead(2, 100)
    try:
        for head in (a, b):
            assert os.stat(head.temp_dir).st_mode & 0o777 == 0o700
            assert os.stat(head.token_path).st_mode & 0o777 == 0o600
            assert re.fullmatch(r"[0-9a-f]{64}", open(head.token_path).read())
            assert os.path.dirname(head.token_path) == head.temp_dir
            assert head.driver_env() == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": head.token_path,
                                         "RAY_task_events_report_interval_ms": "0"}  # no task kept in the GCS
        assert open(a.token_path).read() != open(b.token_path).read()
    finally:
        a.stop(keep_logs=False)
        b.stop(keep_logs=False)
    assert not os.path.exists(a.temp_dir) and not os.path.exists(b.temp_dir)


def test_the_stop_ends_the_whole_session_those_in_a_group_of_their_own_too():
    """A session leader with a child that took a process group of its own (a Ray worker's case): a stop by the process
    group alone would leave the child."""
    leader = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys, time\n"
         "subprocess.Popen([sys.executable, '-c', 'import os, time; os.setpgid(0, 0); time.sleep(60)'])\n"
         "signal = __import__('signal'); signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"],
        start_new_session=True)
    head = RayHead(2, 100)
    head.session = leader.pid
    try:
        deadline = time.monotonic() + 30
        while len(session_pids(leader.pid)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        head.stop(keep_logs=False, grace_s=0.5)  # the leader ignores SIGTERM: SIGKILL after the grace
        assert session_pids(leader.pid) == []
    finally:
        for pid in session_pids(leader.pid):
            os.kill(pid, signal.SIGKILL)
        leader.wait()


def test_a_vital_process_gone_is_named():
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    head = RayHead(2, 100)
    try:
        head.vital = {proc.pid: "raylet"}
        assert head.lost() is None
        proc.kill()
        proc.wait()
        assert head.lost() == f"raylet (pid {proc.pid})"
    finally:
        head.stop(keep_logs=False)


def test_no_session_of_the_kernel_or_init_is_read_as_a_head():
    for session in (0, 1):
        with pytest.raises(ValueError):
            session_pids(session)


# A session whose leader ignores SIGTERM and forks children (that ignore it too) as fast as it can, as a raylet
# starting workers or a front replacing entity workers may while its session is being stopped.
_SPAWNER = """
import signal, subprocess
signal.signal(signal.SIGTERM, signal.SIG_IGN)
for _ in range(2000):
    subprocess.Popen(["sleep", "60"])
signal.pause()
"""


def test_a_process_forked_while_the_session_is_being_stopped_is_stopped_too():
    """The stop signals every process it finds on each look, not only those of its first: before, a child forked
    while the session's processes were being signalled outlived the stop (a soak of the Ray engine left 3 processes
    after the command's SIGTERM had exited 0)."""
    leader = subprocess.Popen([sys.executable, "-c", _SPAWNER], start_new_session=True)
    head = RayHead(2, 100)
    try:
        while len(session_pids(leader.pid)) < 30:
            time.sleep(0.02)
        head.session = leader.pid
        head.stop(keep_logs=False, grace_s=0.2)
        leader.wait(10)
        assert session_pids(leader.pid) == []
    finally:
        if session_pids(leader.pid):
            os.killpg(leader.pid, signal.SIGKILL)
        head.session = None
        head.stop(keep_logs=False)
