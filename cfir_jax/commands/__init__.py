"""One body per command, each `run(config, workdir, ...)`: `index`, `train` (text and Full), `retrieve`, `evaluate`,
`serve`. The scripts index.py, train.py and retrieve.py only parse flags and call one of them."""
