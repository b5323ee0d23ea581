"""The service on Ray Serve: `retrieve.py --index W --serve --engine ray [--address HOST:6379]`.

Starts a Ray of its own (`ray start --head` in a session of its own, sized by the config's `serve` section) or joins
a running cluster (serve.address, --address), deploys the fronts and the index shards (`cfir_jax.serve.deployments`)
and serves until SIGTERM or SIGINT, to it alone or to its process group: the application is deleted gracefully
(every replica answers what it accepted), then the Ray it started is stopped. SIGHUP reloads every shard and front.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from cfir_jax.core.errors import CfirError
from cfir_jax.serve.merge import check_cluster_config
from cfir_jax.serve.resident import config_overrides

APP = "cfir"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve_cluster(workdir: str, config, config_spec: str = "", argv: Sequence[str] = (), method: str = "cfir",
                  host: str | None = None, port: int | None = None, address: str | None = None) -> None:
    """Starts (or joins, serve.address / --address) Ray, deploys the app and serves until SIGTERM or SIGINT, which
    drain it (every accepted request answered); SIGHUP reloads every shard and front."""
    s = config.serve
    methods = list(dict.fromkeys([method, *s.methods]))
    check_cluster_config(config, methods)
    host, port = host or s.host, s.port if port is None else port
    port = port or _free_port(host)
    address = address or s.address or None
    t0 = time.perf_counter()
    head = None
    if address is None:  # a Ray of its own, in a session of its own: a SIGTERM to this command's group drains
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # the head and this driver agree (Ray's default for a head)
        head, address = _start_head(s)
    try:
        # why: Ray (an optional extra) reads RAY_AUTH_MODE when it is imported, after the head above set it
        import ray
        from ray import serve

        # why: the deployments import Ray at their top
        from cfir_jax.serve.deployments import build_app
    except ImportError as e:
        if head is not None:
            _stop_head(head)
        raise CfirError(f"serve.engine=ray needs Ray Serve ({e.name} is missing): pip install -e \".[cluster]\"") \
            from None

    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        serve.start(http_options={"host": host, "port": port})
        app = build_app(workdir, config, config_spec, config_overrides(argv), methods)
        handle = serve.run(app, name=APP, route_prefix="/")
        print(f"serving {workdir} (methods {', '.join(methods)}; {s.shards} shards x {s.shard_replicas} replicas, "
              f"{s.front_replicas} fronts on Ray at {address}) at http://{host}:{port}: loaded and warmed in "
              f"{time.perf_counter() - t0:.1f} s; ready", file=sys.stderr, flush=True)
        _wait_for_signals(handle)
        serve.delete(APP)  # drains: replicas finish their requests (graceful_shutdown_timeout_s)
        if head is not None:
            serve.shutdown()
    finally:
        ray.shutdown()
        if head is not None:
            _stop_head(head)
    print("stopped: every accepted request was answered", file=sys.stderr, flush=True)


def _start_head(settings) -> tuple[int, str]:
    """`ray start --head` on a free port, sized for the deployments (logical CPUs: fractions per replica), in a new
    session; returns (its process group, its address)."""
    need = int(settings.front_replicas) * float(settings.front_num_cpus) + \
        int(settings.shards) * int(settings.shard_replicas) * float(settings.shard_num_cpus)
    port = _free_port("127.0.0.1")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [ray_cli, "start", "--head", f"--port={port}", f"--num-cpus={max(os.cpu_count() or 1, math.ceil(need))}",
           f"--object-store-memory={int(settings.object_store_mb) << 20}", "--include-dashboard=false",
           "--disable-usage-stats"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise CfirError(f"ray start --head failed: {out.strip().splitlines()[-1] if out.strip() else proc.returncode}")
    return proc.pid, f"127.0.0.1:{port}"


def _stop_head(pgid: int) -> None:
    """Stops the processes of the Ray this command started (its process group), and only those."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _wait_for_signals(handle) -> None:
    stop = threading.Event()
    reloads: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: reloads.append(1))
    while not stop.wait(0.2):
        while reloads:
            reloads.pop()
            status = handle.reload.remote().result()
            print(f"reload: {'done' if status == 200 else f'refused ({status}), see GET /readyz'}", file=sys.stderr,
                  flush=True)
