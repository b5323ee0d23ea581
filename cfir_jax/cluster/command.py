"""The service on Ray Serve: `retrieve.py --index W --serve --engine ray [--address HOST:6379]`.

Starts a Ray of its own (`cfir_jax.cluster.ray_head`: a head with a token it makes, sized for every replica it will
place, `cfir_jax.cluster.sizing`) or joins a running cluster (serve.address, --address) that has room for them,
deploys the gateways, fronts and index shards (`cfir_jax.cluster.deployments`), waits at most serve.ready_timeout_s
for every replica, and serves.

Ray's lifetime is the command's. The stop signals are caught before anything starts: SIGTERM or SIGINT, to it alone
or to its process group, at any moment (while the head starts, while deploying, while serving) deletes the
application (gracefully once it serves: every replica answers what it accepted), stops the Ray it started, leaving
no process of it, and exits 0. A Ray it started that dies under it (its raylet or GCS server gone) is named in one
line and the command exits 2 within seconds, for a process manager to restart it, whatever else it is doing (a
reload included). A cluster it joined is left running.

This process decides which version the cluster serves (`cfir_jax.cluster.reload.Coordinator`): SIGHUP, POST
/v1/admin/reload and a part that found the served version gone each ask it for a reload, which runs in a thread of
its own. A reload that is refused, fails or times out is one line, and the served version stays.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from cfir_jax.cluster.door import Door, DoorServer
from cfir_jax.cluster.ray_head import RayHead, free_port
from cfir_jax.cluster.reload import Coordinator, Outcome, Reloader, Target
from cfir_jax.cluster.shard import committed_id
from cfir_jax.cluster.sizing import Needs, check_reachable, check_room, head_cpus, needs
from cfir_jax.core.errors import CfirError, first_line
from cfir_jax.serve.middleware import bind
from cfir_jax.serve.resident import check_complete, check_intact, config_overrides, load_config, model_family

APP = "cfir"


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

    def take_reloads(self) -> int:
        """The SIGHUPs since the last call."""
        n, self.reloads = self.reloads, 0
        return n


@dataclasses.dataclass
class _Run:
    """What the command has started so far, for its stop."""
    head: RayHead | None = None
    ray: object = None
    serve: object = None
    submitted: bool = False  # the application was handed to Serve
    serving: bool = False  # every replica was ready
    door: DoorServer | None = None  # the command's HTTP server, in front of Ray's proxy (cfir_jax.cluster.door)


class DiskWorkdir:
    """The command's view of the workdir (`cfir_jax.cluster.reload.Workdir`): the committed version's id, and the
    checks a version passes before the cluster serves it: complete, every byte verified (serve.verify_on_reload),
    the model of the family the service started with."""

    def __init__(self, workdir: str, config_spec: str, overrides: Sequence[str]):
        self.workdir, self.config_spec, self.overrides = workdir, config_spec, list(overrides)
        self.family = model_family(workdir)

    def current(self) -> str:
        return committed_id(self.workdir)

    def check(self, vid: str) -> None:
        config = load_config(self.workdir, self.config_spec, self.overrides)
        check_complete(self.workdir)
        if config.serve.verify_on_reload:
            check_intact(self.workdir)
        family = model_family(self.workdir)
        if family != self.family:
            changed = ", ".join(f"{k} {self.family[k]} -> {family[k]}" for k in family if family[k] != self.family[k])
            raise CfirError(f"{self.workdir}: the new index's model is of another family ({changed}); restart the "
                            "service to serve it")
        if committed_id(self.workdir) != vid:
            raise CfirError("the workdir changed while the reload checked it; reload again when index.py is done")


def serve_cluster(workdir: str, config, config_spec: str = "", argv: Sequence[str] = (), method: str = "cfir",
                  host: str | None = None, port: int | None = None, address: str | None = None) -> None:
    """Starts (or joins, serve.address / --address) Ray, deploys the app and serves until SIGTERM or SIGINT, which
    drain it (every accepted request answered); SIGHUP reloads."""
    s = config.serve
    methods = list(dict.fromkeys([method, *s.methods]))
    need = needs(s)
    host, port = host or s.host, s.port if port is None else port
    address = address or s.address or None
    cpus = head_cpus(s, need, os.cpu_count() or 1) if address is None else 0  # refused before anything starts
    sock = bind(host, port)  # the door's: a taken port is said before Ray starts
    port, inner = sock.getsockname()[1], free_port("127.0.0.1")  # Ray's proxy listens behind the door
    t0 = time.perf_counter()
    signals = _Signals()
    run, lost, ended = _Run(), None, False
    try:
        if address is None:  # a Ray of its own, in a session of its own, with a token of its own
            run.head = RayHead(cpus, int(s.object_store_mb))
            os.environ.pop("RAY_AUTH_TOKEN", None)
            os.environ.update(run.head.driver_env())
        run.ray, run.serve, deployments = _import_ray()  # Ray missing: said before a head starts
        if run.head is not None:
            run.head.launch()
            address = run.head.address
        _connect(run, address, need, signals)
        run.serve.start(http_options={"host": "127.0.0.1", "port": inner})
        reloader = _reloader(run, deployments, workdir, config, config_spec, config_overrides(argv))
        app = deployments.build_app(workdir, config, config_spec, config_overrides(argv), methods,
                                    reloader.relay.actor)
        run.submitted = True
        run.serve.run_many([run.serve.RunTarget(target=app, name=APP, route_prefix="/")],
                           wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        _wait_ready(run, float(s.ready_timeout_s), reloader)
        run.serving = True
        run.door = DoorServer(Door(s, f"http://127.0.0.1:{inner}"), sock)
        run.door.start()
        print(f"serving {workdir} (methods {', '.join(methods)}; version {reloader.coordinator.target.version}; "
              f"{_layout(s)} on Ray at {address}) at http://{host}:{port}: loaded and warmed in "
              f"{time.perf_counter() - t0:.1f} s; ready", file=sys.stderr, flush=True)
        _serve(run, signals, reloader)
    except _Stopped:
        ended = True
    except _Lost as e:
        lost = str(e)
    finally:
        signals.stopping = True  # a second signal no longer interrupts the stop
        _stop(run, lost, keep_logs=not ended)
        sock.close()
    if lost:
        raise CfirError(f"the Ray this command started lost its {lost}: every replica on it is gone; its logs: "
                        f"{run.head.logs}; exiting so that a process manager restarts the service")
    print("stopped: every accepted request was answered" if run.serving else
          "stopped before it was ready" + (": the Ray it started is stopped" if run.head else ""),
          file=sys.stderr, flush=True)


def _layout(s) -> str:
    shards = f"{s.shards} shards x {s.shard_replicas} replicas, " if int(s.shards) > 1 else \
        "1 shard (each front's own), "
    gateways = f", {s.gateway_replicas} gateways" if int(s.front_replicas) > 1 else ""
    return f"{shards}{s.front_replicas} front{'s' if int(s.front_replicas) > 1 else ''}{gateways}"


def _reloader(run: _Run, deployments, workdir: str, config, config_spec: str, overrides: list[str]) -> Reloader:
    """The relay actor with the version served at start published, and the command's side of the protocol. An actor
    not started by serve.ready_timeout_s is the start's deadline passed: the same line as replicas not running."""
    actor = deployments.make_relay()
    target = Target(1, committed_id(workdir))
    started = float(config.serve.ready_timeout_s)  # the first call waits for the actor's process to start
    try:
        deployments.RemoteRelay(actor, timeout_s=started).publish(target)
    except Exception as e:  # noqa: BLE001 - Ray's GetTimeoutError or the actor's death, types of Ray's
        raise CfirError(f"not ready after {started:g} s (serve.ready_timeout_s): the relay actor has not started "
                        f"({type(e).__name__}: {first_line(e)}){_logs(run)}") from None
    relay = deployments.RemoteRelay(actor, timeout_s=2.0)  # once started, a tick never waits long on it
    shards = int(config.serve.shards)
    coordinator = Coordinator(DiskWorkdir(workdir, config_spec, overrides),
                              deployments.ShardPreparer(APP, shards if shards > 1 else 0), relay, target,
                              prepare_timeout_s=float(config.serve.ready_timeout_s))

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def after(outcome: Outcome) -> None:  # the reload's thread: until every live front serves the new version
        deadline = time.monotonic() + float(config.serve.ready_timeout_s)
        while time.monotonic() < deadline:
            try:
                behind = coordinator.lagging()
            except Exception as e:  # noqa: BLE001 - the relay restarts; asked again
                behind = {"?": first_line(e)}
            if not behind:
                return say(f"reload: every front serves version {outcome.target.version}")
            time.sleep(0.5)
        say(f"reload: version {outcome.target.version}: fronts still behind after "
            f"{config.serve.ready_timeout_s:g} s: {'; '.join(f'{f[:8]} at {w}' for f, w in behind.items())}")

    def spawn(fn) -> None:
        threading.Thread(target=fn, name="cfir-reload", daemon=True).start()

    return Reloader(coordinator, relay, spawn, say, after)


def _import_ray():
    try:
        # why: Ray (an optional extra) reads RAY_AUTH_MODE when it is imported, after the head's was set
        import ray
        from ray import serve

        # why: the deployments import Ray at their top
        from cfir_jax.cluster import deployments
    except ImportError as e:
        raise CfirError(f"serve.engine=ray needs Ray Serve ({e.name} is missing): pip install -e \".[cluster]\"") \
            from None
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # this command's stderr: its own lines
    return ray, serve, deployments


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
        hint = "" if run.head else ("; a cluster with token authentication needs RAY_AUTH_MODE=token and its token "
                                    "(RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)")
        said = first_line(e) if str(e).strip() else ""
        raise CfirError(f"cannot join {where}: {type(e).__name__}: {said}"[:400] + hint) \
            from None
    finally:
        signals.install()
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    if run.head is not None:
        print(run.head.join_line(run.ray.util.get_node_ip_address()), file=sys.stderr, flush=True)
    check_room(need, run.ray.available_resources(), where)


def _wait_ready(run: _Run, timeout_s: float, reloader: Reloader) -> None:
    """Until every replica runs: a line when the state changes, one line and CfirError when a deployment failed,
    the head died or serve.ready_timeout_s passed (never a silent wait for a replica that cannot be placed). A
    front started after a commit asks for a reload meanwhile: answered here too."""
    start, said = time.monotonic(), ""
    while True:
        reloader.tick()
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


def _serve(run: _Run, signals: _Signals, reloader: Reloader) -> None:
    """Serves until a stop signal (raises _Stopped) or, for a Ray of its own, until a vital process of it is gone
    (raises _Lost naming it), checked every half second whatever else runs; SIGHUPs and the parts' asks go to the
    reloader, whose reloads run beside this loop."""
    while True:
        time.sleep(0.5)
        lost = run.head.lost() if run.head else None
        if lost:
            raise _Lost(f"{lost} while serving")
        reloader.tick(signals.take_reloads())


def _stop(run: _Run, lost: str | None, keep_logs: bool) -> None:
    """Deletes the application (a drain, once it served) and stops the Ray this command started, keeping its logs
    after a failure; a cluster it joined keeps running. A head that died is not asked anything: its remains end at
    once, before this driver lets go of it."""
    if lost:
        run.head.stop(keep_logs=True, grace_s=0)
    try:
        if run.ray is not None and run.ray.is_initialized() and not lost:
            if run.door is not None:
                run.door.door.stopping = True  # a request lost from now on is a 503 at once, never sent again
            if run.submitted and (run.serving or run.head is None):
                run.serve.delete(APP)  # drains: replicas finish their requests (graceful_shutdown_timeout_s)
            if run.door is not None:
                run.door.stop()  # the requests it accepted are answered (Ray's proxy's 404s: one JSON line each)
            if run.head is not None and run.serving:
                run.serve.shutdown()
        if run.ray is not None:
            run.ray.shutdown()
    except Exception as e:  # noqa: BLE001 - the stop goes on; the head is ended below whatever Ray said
        print(f"stopping: {type(e).__name__}: {first_line(e) if str(e).strip() else ''}", file=sys.stderr, flush=True)
    finally:
        if run.door is not None:
            run.door.stop(timeout_s=5.0)
        if run.head is not None:
            run.head.stop(keep_logs=keep_logs)
