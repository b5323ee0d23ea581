"""The serve command (`retrieve.py --index W --serve`): the resident HTTP service of `cfir_jax.serve` over one
workdir, until stopped; with serve.engine="ray" (or --engine ray) on Ray Serve (`cfir_jax.serve.cluster`)."""

from __future__ import annotations

from collections.abc import Sequence

import ml_collections

from cfir_jax.core.errors import CfirError
from cfir_jax.serve import serve
from cfir_jax.serve.cluster import serve_cluster


def run(config: ml_collections.ConfigDict, workdir: str, config_spec: str = "", argv: Sequence[str] = (),
        method: str = "cfir", host: str | None = None, port: int | None = None, engine: str | None = None,
        address: str | None = None) -> None:
    """Loads the index of `workdir`, binds host:port and serves until SIGTERM (`cfir_jax.serve.serve`: `argv`'s
    `--config.*` overrides are applied again to the workdir's config, or to `config_spec`, on a reload)."""
    engine = engine or config.serve.engine
    if engine == "local":
        serve(workdir, config, config_spec, argv, method, host, port)
    elif engine == "ray":
        serve_cluster(workdir, config, config_spec, argv, method, host, port, address)
    else:
        raise CfirError(f"serve.engine={engine!r}: use local or ray")
