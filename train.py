"""Trains CFIR's language expert on (summary, image) pairs of the index in --workdir.

The command's usage and body: `cfir_jax.commands.scripts.train_main` (`python train.py --help`);
pip installs the same command as `cfir-train`.
"""

from cfir_jax.commands.scripts import train_main as main

if __name__ == "__main__":
    main()
