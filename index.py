"""Builds the offline index of CFIR: corpus, image cache, (encoder), entities, summaries, entity index.

The command's usage and body: `cfir_jax.commands.scripts.index_main` (`python index.py --help`);
pip installs the same command as `cfir-index`.
"""

from cfir_jax.commands.scripts import index_main as main

if __name__ == "__main__":
    main()
