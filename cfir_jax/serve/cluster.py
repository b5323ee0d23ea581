"""The service on Ray Serve: `retrieve.py --index W --serve --engine ray [--address HOST:6379]`.

Starts a Ray of its own (`cfir_jax.serve.ray_head`: a head with a token it makes, sized for every replica it will
place) or joins a running cluster (serve.address, --address) that has room for them, deploys the gateways, fronts
and index shards (`cfir_jax.serve.deployments`), waits at most serve.ready_timeout_s for every replica, and serves.

Ray's lifetime is the command's. The stop signals are caught before anything starts: SIGTERM or SIGINT, to it alone
or to its process group, at any moment (while the head starts, while deploying, while serving) deletes the
application (gracefully once it serves: every replica answers what it accepted), stops the Ray it started, leaving
no process of it, and exits 0. A Ray it started that dies under it (its raylet or GCS server gone) is named in one
line and the command exits 2 within seconds, for a process manager to restart it. A cluster it joined is left
running. SIGHUP reloads every shard and front.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence

from cfir_jax.core.errors import CfirError
from cfir_jax.serve.merge import check_cluster_config
from cfir_jax.serve.ray_head import RayHead, free_port
from cfir_jax.serve.resident import config_overrides

APP = "cfir"
_EPS = 1e-6  # Ray counts resources in 1e-4 units


@dataclasses.dataclass(frozen=True)
class Needs:
    """What the application reserves in Ray: CPUs, GPUs, and the sum written out for a refusal."""
    cpus: float
    gpus: float
    parts: str


def needs(s) -> Needs:
    """Every replica's reservation (serve.*_replicas x serve.*_num_cpus / front_num_gpus), the gateways included."""
    fronts, shard_replicas = int(s.front_replicas), int(s.shards) * int(s.shard_replicas)
    gateways = int(s.gateway_replicas) if fronts > 1 else 0  # one front is the ingress itself (deployments.build_app)
    terms = [(fronts, "front", float(s.front_num_cpus)), (shard_replicas, "shard replica", float(s.shard_num_cpus)),
             (gateways, "gateway", float(s.gateway_num_cpus))]
    parts = " + ".join(f"{n} {name}{'s' if n > 1 else ''} x {cpus:g}" for n, name, cpus in terms if n)
    return Needs(sum(n * cpus for n, _, cpus in terms), fronts * float(s.front_num_gpus), parts)


def head_cpus(s, need: Needs, cores: int) -> int:
    """The logical CPUs of a head this command starts: serve.head_num_cpus, or (0) enough for every replica and at
    least the machine's cores. One line when serve.head_num_cpus is too few, before anything starts."""
    if int(s.head_num_cpus) <= 0:
        return max(cores, math.ceil(need.cpus - _EPS))
    if need.cpus > int(s.head_num_cpus) + _EPS:
        raise CfirError(f"the application needs {need.cpus:g} CPUs ({need.parts}), the head has "
                        f"{int(s.head_num_cpus)} (serve.head_num_cpus): lower serve.*_num_cpus or the replicas, or "
                        "raise serve.head_num_cpus (0: sized for the replicas)")
    return int(s.head_num_cpus)


def check_room(need: Needs, free: dict, where: str) -> None:
    """One line when the Ray at `where` has fewer free CPUs or GPUs than the application reserves."""
    cpus, gpus = float(free.get("CPU", 0.0)), float(free.get("GPU", 0.0))
    if need.cpus > cpus + _EPS:
        raise CfirError(f"the application needs {need.cpus:g} CPUs ({need.parts}), {where} has {cpus:g} free: lower "
                        "serve.*_num_cpus or the replicas, or add a host to the cluster")
    if need.gpus > gpus + _EPS:
        raise CfirError(f"the application needs {need.gpus:g} GPUs (serve.front_replicas x serve.front_num_gpus), "
                        f"{where} has {gpus:g} free: lower serve.front_num_gpus, or add a host with GPUs")


class _Lost(Exception):
    """A vital process of the Ray this command started is gone (the message names it and when)."""


class _Stopped(BaseException):
    """SIGTERM or SIGINT arrived: the command stops what it started (BaseException: no `except Exception` eats it)."""


class _Signals:
    """Caught from before anything starts: the first SIGTERM or SIGINT raises _Stopped in the main thread, wherever it
    waits; later ones are ignored while the command stops. SIGHUP asks for a reload."""

    def __init__(self):
        self.stopping, self.reloads = False, 0
        self.install()

    def install(self) -> None:
        """(Again after ray.init: Ray's failure handler takes SIGTERM over and aborts the driver, leaving the head.)"""
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGHUP, self._reload)

    def _stop(self, signum, frame):
        if not self.stopping:
            self.stopping = True
            raise _Stopped(signal.Signals(signum).name)

    def _reload(self, signum, frame):
        self.reloads += 1


@dataclasses.dataclass
class _Run:
    """What the command has started so far, for its stop."""
    head: RayHead | None = None
    ray: object = None
    serve: object = None
    submitted: bool = False  # the application was handed to Serve
    serving: bool = False  # every replica was ready


def serve_cluster(workdir: str, config, config_spec: str = "", argv: Sequence[str] = (), method: str = "cfir",
                  host: str | None = None, port: int | None = None, address: str | None = None) -> None:
    """Starts (or joins, serve.address / --address) Ray, deploys the app and serves until SIGTERM or SIGINT, which
    drain it (every accepted request answered); SIGHUP reloads every shard and front."""
    s = config.serve
    methods = list(dict.fromkeys([method, *s.methods]))
    check_cluster_config(config, methods)
    need = needs(s)
    host, port = host or s.host, s.port if port is None else port
    port = port or free_port(host)
    address = address or s.address or None
    cpus = head_cpus(s, need, os.cpu_count() or 1) if address is None else 0  # refused before anything starts
    t0 = time.perf_counter()
    signals = _Signals()
    run, lost, ended = _Run(), None, False
    try:
        if address is None:  # a Ray of its own, in a session of its own, with a token of its own
            run.head = RayHead(cpus, int(s.object_store_mb))
            os.environ.pop("RAY_AUTH_TOKEN", None)
            os.environ.update(run.head.driver_env())
        run.ray, run.serve, build_app = _import_ray()  # Ray missing: said before a head starts
        if run.head is not None:
            run.head.launch()
            address = run.head.address
        _connect(run, address, need, signals)
        run.serve.start(http_options={"host": host, "port": port})
        app = build_app(workdir, config, config_spec, config_overrides(argv), methods)
        run.submitted = True
        run.serve.run_many([run.serve.RunTarget(target=app, name=APP, route_prefix="/")],
                           wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        _wait_ready(run, float(s.ready_timeout_s))
        handle = run.serve.get_app_handle(APP)
        run.serving = True
        print(f"serving {workdir} (methods {', '.join(methods)}; {s.shards} shards x {s.shard_replicas} replicas, "
              f"{s.front_replicas} fronts, {s.gateway_replicas} gateways on Ray at {address}) at http://{host}:{port}: "
              f"loaded and warmed in {time.perf_counter() - t0:.1f} s; ready", file=sys.stderr, flush=True)
        _serve(handle, signals, run.head)
    except _Stopped:
        ended = True
    except _Lost as e:
        lost = str(e)
    finally:
        signals.stopping = True  # a second signal no longer interrupts the stop
        _stop(run, lost, keep_logs=not ended)
    if lost:
        raise CfirError(f"the Ray this command started lost its {lost}: every replica on it is gone; its logs: "
                        f"{run.head.logs}; exiting so that a process manager restarts the service")
    print("stopped: every accepted request was answered" if run.serving else
          "stopped before it was ready" + (": the Ray it started is stopped" if run.head else ""),
          file=sys.stderr, flush=True)


def _import_ray():
    try:
        # why: Ray (an optional extra) reads RAY_AUTH_MODE when it is imported, after the head's was set
        import ray
        from ray import serve

        # why: the deployments import Ray at their top
        from cfir_jax.serve.deployments import build_app
    except ImportError as e:
        raise CfirError(f"serve.engine=ray needs Ray Serve ({e.name} is missing): pip install -e \".[cluster]\"") \
            from None
    return ray, serve, build_app


def _connect(run: _Run, address: str, need: Needs, signals: _Signals) -> None:
    """ray.init as a driver of `address`; one line when it refuses this driver or has no room for the replicas."""
    where = "the head it started" if run.head else f"the cluster at {address}"
    if run.head is None:
        check_reachable(address)
    # ray.init installs Ray's failure handler over SIGTERM, which aborts the driver: with a head of its own, a stop
    # signal is held until this command's handlers are back (a joined cluster has nothing of this command's yet)
    held = signal.pthread_sigmask(signal.SIG_BLOCK if run.head else signal.SIG_UNBLOCK,
                                  {signal.SIGTERM, signal.SIGINT})
    try:
        run.ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    except Exception as e:  # noqa: BLE001 - Ray's refusals (authentication, no cluster there) are many types
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        hint = "" if run.head else ("; a cluster with token authentication needs RAY_AUTH_MODE=token and its token "
                                    "(RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)")
        raise CfirError(f"cannot join {where}: {type(e).__name__}: {lines[0] if lines else ''}"[:400] + hint) \
            from None
    finally:
        signals.install()
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    if run.head is not None:
        print(run.head.join_line(run.ray.util.get_node_ip_address()), file=sys.stderr, flush=True)
    check_room(need, run.ray.available_resources(), where)


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """One line when nothing listens at HOST:PORT (Ray's driver would retry for minutes without a word)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():  # "auto", a ray:// address: Ray resolves it
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise CfirError(f"cannot join the cluster at {address}: {e.strerror or type(e).__name__}; is its head "
                        "running (ray start --head) and the address serve.address / --address right?") from None


def _wait_ready(run: _Run, timeout_s: float) -> None:
    """Until every replica runs: a line when the state changes, one line and CfirError when a deployment failed,
    the head died or serve.ready_timeout_s passed (never a silent wait for a replica that cannot be placed)."""
    start, said = time.monotonic(), ""
    while True:
        lost = run.head.lost() if run.head else None
        if lost:
            raise _Lost(f"{lost} while deploying")
        app = run.serve.status().applications.get(APP)
        state = app.status if app else "NOT_STARTED"
        if state == "RUNNING":
            return
        summary = _summary(app)
        if state in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise CfirError(f"the application failed to deploy: {summary}{_logs(run)}")
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise CfirError(f"not ready after {timeout_s:g} s (serve.ready_timeout_s): {summary}{_logs(run)}")
        if summary != said:
            print(f"deploying ({waited:.0f} s): {summary}", file=sys.stderr, flush=True)
            said = summary
        time.sleep(1.0)


def _logs(run: _Run) -> str:
    return f" (Ray's logs: {run.head.logs})" if run.head else ""


def _summary(app) -> str:
    """The deployments' replicas in one line, with the first line of each one's message (why it waits, or failed)."""
    if app is None:
        return "the application is not created yet"
    parts = []
    for name, d in sorted(app.deployments.items()):
        states = {str(getattr(k, "value", k)): v for k, v in d.replica_states.items()}
        running, total = states.get("RUNNING", 0), sum(states.values())
        parts.append(f"{name} {running}/{total} running" + (f" ({_gist(d.message)})" if d.message else ""))
    state = getattr(app.status, "value", app.status)
    return "; ".join(parts) or _gist(app.message or "") or f"the application is {state}"


def _gist(message: str) -> str:
    """Ray's message in a line: its first sentence, and its last line when that names an error (a traceback's end)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return ""
    first = lines[0].split(". ")[0].rstrip(".")
    last = lines[-1] if len(lines) > 1 and ("Error" in lines[-1] or "Exception" in lines[-1]) else ""
    return (first[:160] + (f": {last[:240]}" if last else "")).strip()


def _serve(handle, signals: _Signals, head: RayHead | None) -> None:
    """Serves until a stop signal (raises _Stopped) or, for a Ray of its own, until a vital process of it is gone
    (raises _Lost naming it). SIGHUP reloads."""
    while True:
        time.sleep(0.5)
        lost = head.lost() if head else None
        if lost:
            raise _Lost(f"{lost} while serving")
        while signals.reloads:
            signals.reloads -= 1
            status = handle.reload.remote().result()
            print(f"reload: {'done' if status == 200 else f'refused ({status}), see GET /readyz'}", file=sys.stderr,
                  flush=True)


def _stop(run: _Run, lost: str | None, keep_logs: bool) -> None:
    """Deletes the application (a drain, once it served) and stops the Ray this command started, keeping its logs
    after a failure; a cluster it joined keeps running. A head that died is not asked anything: its remains end at
    once, before this driver lets go of it."""
    if lost:
        run.head.stop(keep_logs=True, grace_s=0)
    try:
        if run.ray is not None and run.ray.is_initialized() and not lost:
            if run.submitted and (run.serving or run.head is None):
                run.serve.delete(APP)  # drains: replicas finish their requests (graceful_shutdown_timeout_s)
            if run.head is not None and run.serving:
                run.serve.shutdown()
        if run.ray is not None:
            run.ray.shutdown()
    except Exception as e:  # noqa: BLE001 - the stop goes on; the head is ended below whatever Ray said
        print(f"stopping: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr,
              flush=True)
    finally:
        if run.head is not None:
            run.head.stop(keep_logs=keep_logs)
