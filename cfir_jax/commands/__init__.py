"""One body per command, each a `run(...)`: `build` (index.py's: build, add, remove, compact, add-entities),
`verify`, `train` (text and Full), `retrieve`, `evaluate`, `fit_reranker`, `serve` and `compile_only`; `flags` holds
the scripts' flags. The scripts index.py, train.py and retrieve.py only parse flags and call one of them."""
