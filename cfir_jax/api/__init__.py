"""The library's front door, one implementation under two doors: the Python API (`index`: `open` and `Index`;
`operations`: `build`, `train`, `verify` and the collection's changes) and the HTTP client of the service (`client`),
which answer with the same records (`cfir_jax.retrieve.results`). The commands' bodies (`cfir_jax.commands`) call
these. `import cfir_jax` names them lazily (`cfir_jax.open`, `cfir_jax.Client`, ...), loading nothing heavy."""
