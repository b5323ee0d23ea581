"""Trains CFIR's language expert on (summary, image) pairs of the index in --workdir.

    python train.py --config configs/large.py --workdir W --config.init_model=...   # see README for GPU/TPU
    python train.py --config configs/demo.py --workdir demo_work
    python train.py --config configs/demo.py:full --workdir demo_work       # D-BEiT-3 Full: both towers, pixels
    python train.py --config configs/large.py --compile-only --topology v5p:4x4x4   # TPU programs, no TPU needed
"""

from cfir_jax.core import cli
from cfir_jax.core.cli import cli_main


@cli_main
def main():
    args, config = cli.parse(__doc__.splitlines()[0])
    if args.compile_only:
        # why: libtpu's compiler loads only for --compile-only
        from cfir_jax.commands import compile_only

        return compile_only.run("train", config, args.topology)
    cli.maybe_initialize_distributed()
    # why: JAX, flax and orbax load once the flags and the config are read
    from cfir_jax.commands import train

    train.run(config, args.workdir)


if __name__ == "__main__":
    main()
