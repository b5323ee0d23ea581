"""The serve command (`retrieve.py --index W --serve`): the resident HTTP service of `cfir_jax.serve` over one
workdir, until stopped."""

from __future__ import annotations

from collections.abc import Sequence

import ml_collections

from cfir_jax.serve import serve


def run(config: ml_collections.ConfigDict, workdir: str, config_spec: str = "", argv: Sequence[str] = (),
        method: str = "cfir", host: str | None = None, port: int | None = None) -> None:
    """Loads the index of `workdir`, binds host:port and serves until SIGTERM (`cfir_jax.serve.serve`: `argv`'s
    `--config.*` overrides are applied again to the workdir's config, or to `config_spec`, on a reload)."""
    serve(workdir, config, config_spec, argv, method, host, port)
