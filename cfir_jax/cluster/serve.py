"""serve.engine "ray" (`retrieve.py --index W --serve --engine ray`): the service on Ray Serve, declared here, light,
so that the config's check knows the engine without loading the cluster (`cfir_jax.core.config_check.SERVE_ENGINES`
finds it by this module's name). Its command is `cfir_jax.cluster.command.serve_cluster`."""

from __future__ import annotations

from collections.abc import Sequence

import ml_collections

from cfir_jax.core.config_check import SERVE_ENGINES, ServeEngine


def serve_on_ray(workdir: str, config: ml_collections.ConfigDict, config_spec: str, argv: Sequence[str], method: str,
                 host: str | None, port: int | None, address: str | None) -> None:
    """Serves `workdir` on Ray Serve (joining the cluster at `address`, or starting a local one) until stopped."""
    # why: the cluster's command (the resident index: JAX, flax; then Ray Serve) loads only when the engine is chosen
    from cfir_jax.cluster.command import serve_cluster

    return serve_cluster(workdir, config, config_spec, argv, method, host, port, address)


SERVE_ENGINES.register(ServeEngine("ray", serve_on_ray))  # Ray Serve: fronts and index shards
