"""The floor every room stands on: one-line user errors (`errors`) and machine faults (`faults`), progress bars,
hosts (jax.distributed processes), command-line flags and `cli_main` (`cli`), and the config tree with the upgrade of
an older workdir's config (`config`, `config_upgrade`), JSON lines read with per-line errors (`jsonl`), the
platforms JAX may use on this host (`platforms`) and the C library's heap (`memory`). Nothing here imports another
room."""
