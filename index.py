"""Builds the offline index of CFIR: corpus, image cache, (encoder), entities, summaries, entity index.

    python index.py --config configs/base.py --workdir W \
        --config.index.corpus.texts=AToMiC-Texts-v0.2.1 --config.index.corpus.images=AToMiC-Images-v0.2 \
        --config.index.corpus.qrels=AToMiC-Qrels-v0.2 --config.index.encoder=models/beit3_base_itc \
        --config.tokenizer=beit3.spm
    python index.py --config configs/demo.py --workdir demo_work        # the synthetic world
    python index.py --config ... --workdir W --add-entities new_entities.txt
    python index.py --workdir W --add new/          # new documents and images: documents.jsonl, images/, qrels/
    python index.py --workdir W --remove ids.txt    # image or document ids, one a line: never returned again
    python index.py --workdir W --compact           # rewrite the stores without the removed rows
    python index.py --verify --workdir W     # every store against the checksums recorded when it was built
    python index.py --config configs/base.py --compile-only --topology v5e:2x4   # image encoding, entity top-K

On several hosts, run the same command on every host (jax.distributed: see cfir_jax/index/runner.py).
"""

import sys

from cfir_jax.commands import flags
from cfir_jax.core import cli
from cfir_jax.core.cli import cli_main


@cli_main
def main():
    if "--verify" in sys.argv[1:]:  # a reader: no config, no lock, no JAX
        # why: each command loads only its own stack (the verifier: numpy; a build: JAX, flax, spaCy)
        from cfir_jax.commands import verify

        sys.exit(verify.run(flags.verify_args().workdir))
    # A change of a built collection reads the config the index was built with unless --config is given.
    change = any(flag in sys.argv[1:] for flag in ("--add", "--remove", "--compact"))
    args, config = cli.parse(__doc__.splitlines()[0], flags.index_flags, config_from_workdir=change)
    if args.compile_only:
        # why: libtpu's compiler loads only for --compile-only
        from cfir_jax.commands import compile_only

        return compile_only.run("index", config, args.topology)
    cli.maybe_initialize_distributed()
    # why: the builders (JAX, flax, spaCy) load once the flags and the config are read
    from cfir_jax.commands import index

    index.run(config, args.workdir, tuple(s for s in args.stages.split(",") if s), args.add_entities,
              {"add": args.add, "remove": args.remove, "compact": args.compact})


if __name__ == "__main__":
    main()
