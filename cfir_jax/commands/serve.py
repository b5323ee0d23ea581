"""The serve command (`retrieve.py --index W --serve [--host 127.0.0.1] [--port 8080]`): the resident HTTP service of
`cfir_jax.serve` over one workdir, until stopped.

One process loads the stores and models once, warms every shape it will send, then answers over HTTP (FastAPI on
uvicorn) until SIGTERM or SIGINT (to it alone or to its process group), which stops accepting, answers every request
already accepted and exits 0. SIGHUP reloads the workdir (`cfir_jax.serve.resident.IndexHolder.reload`, after
verifying it). Settings: the config's `serve` section (`cfir_jax.core.config_serve`). With serve.engine="ray"
(or --engine ray) the same API runs on Ray Serve, the index in shards (`cfir_jax.cluster`).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import sys
import time
from collections.abc import Sequence

import ml_collections

from cfir_jax.core.config_check import SERVE_ENGINES, ServeEngine


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the service runs (the flags; None: the config's serve section): the `engine` ("local": this process;
    "ray": Ray Serve, joining the cluster at `address` or starting a local one), bound to `host`:`port`."""

    engine: str | None = None
    host: str | None = None
    port: int | None = None
    address: str | None = None


def run(config: ml_collections.ConfigDict, workdir: str, *, config_spec: str = "", argv: Sequence[str] = (),
        method: str = "cfir", placement: Placement = Placement()) -> None:
    """Loads the index of `workdir`, binds host:port and serves until SIGTERM, where `placement` says.

    config: as parsed from the command line `argv`, whose `--config.*` overrides a reload applies again to the
    workdir's config (or to `config_spec`, the --config file)."""
    engine = placement.engine or config.serve.engine
    return SERVE_ENGINES[engine].serve(workdir, config, config_spec, argv, method, placement.host, placement.port,
                                       placement.address)


def serve_local(workdir: str, config: ml_collections.ConfigDict, config_spec: str, argv: Sequence[str], method: str,
                host: str | None, port: int | None, address: str | None) -> None:
    """serve.engine "local": this one process (address: unused, there is no cluster to join)."""
    settings = config.serve
    host = host or settings.host
    port = settings.port if port is None else port
    # why: the service's modules load with the service, after the flags are read (as serve_http's do)
    from cfir_jax.serve.middleware import bind

    sock = bind(host, port)  # before minutes of loading: a taken port is said at once
    sock.set_inheritable(True)
    serve_http(config, workdir, sock, config_spec=config_spec, argv=argv, method=method)


def serve_http(config: ml_collections.ConfigDict, workdir: str, sock: socket.socket, *, config_spec: str,
               argv: Sequence[str], method: str) -> None:
    """The FastAPI app on uvicorn over the bound `sock`, until SIGTERM or SIGINT (then exit 0, every accepted request
    answered)."""
    # why: FastAPI, uvicorn and the Retriever (JAX, flax) load when serving starts
    import uvicorn

    from cfir_jax.serve.app import create_app
    from cfir_jax.serve.middleware import KEEP_ALIVE_S, http_protocol
    from cfir_jax.serve.resident import IndexHolder, config_overrides
    from cfir_jax.serve.service import Service

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("cfir_jax.serve").setLevel(logging.INFO)
    settings = config.serve
    methods = list(dict.fromkeys([method, *settings.methods]))
    t0 = time.perf_counter()
    holder = IndexHolder(workdir, config_spec, config_overrides(argv), methods, int(settings.max_batch), config)
    app = create_app(Service(holder, settings))
    bound = sock.getsockname()
    url = f"http://{bound[0] if ':' not in bound[0] else f'[{bound[0]}]'}:{bound[1]}"
    print(f"serving {workdir} (index {holder.current.fingerprint}, methods {', '.join(methods)}) at {url}: "
          f"loaded and warmed in {time.perf_counter() - t0:.1f} s; ready", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                           timeout_keep_alive=KEEP_ALIVE_S, http=http_protocol()))
    # uvicorn re-raises the signal that stopped it once it has drained; it then reaches these no-op handlers, so a
    # graceful stop exits 0, whether SIGTERM or SIGINT (Ctrl-C, systemctl stop, a container's init: often sent to
    # the whole process group, whose entity workers ignore both and leave the stop to this process).
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    server.run(sockets=[sock])
    print("stopped: every accepted request was answered", file=sys.stderr, flush=True)



SERVE_ENGINES.register(ServeEngine("local", serve_local))  # this one process (FastAPI on uvicorn)
