"""Finds the images of a document with CFIR (entities -> candidate union -> summary re-ranking).

The command's usage and body: `cfir_jax.commands.scripts.retrieve_main` (`python retrieve.py --help`);
pip installs the same command as `cfir-retrieve`.
"""

from cfir_jax.commands.scripts import retrieve_main as main

if __name__ == "__main__":
    main()
