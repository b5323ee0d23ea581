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

from cfir_jax.core import cli
from cfir_jax.core.cli import cli_main


def _flags(parser):
    from cfir_jax.index.runner import STAGES

    parser.add_argument("--stages", default="", help="comma-separated subset of the stages to (re)build, of (in "
                        f"order): {', '.join(STAGES)}; default: all")
    parser.add_argument("--add-entities", default="", help="file of entity texts (one per line) to append")
    parser.add_argument("--add", default="", help="new documents and images to append to the built collection: a "
                        "directory (documents.jsonl|parquet, images.jsonl|parquet or images/, qrels/), a directory "
                        "of image files, or a .jsonl/.parquet file of image rows (docs/collection.md)")
    parser.add_argument("--remove", default="", help="file of image or document ids (one per line; image:ID or "
                        "document:ID where an id is both) that no method returns from now on")
    parser.add_argument("--compact", action="store_true", help="rewrite the stores without the removed image rows")
    parser.add_argument("--verify", action="store_true", help="re-read every store of --workdir against the "
                        "checksums recorded when it was built, name each damaged file, build nothing (exit 2 if any)")


@cli_main
def main():
    if "--verify" in sys.argv[1:]:  # a reader: no config, no lock, no JAX
        import argparse

        from cfir_jax.stores.integrity import verify_command

        p = argparse.ArgumentParser(description="checks every store of W against its recorded checksums")
        p.add_argument("--verify", action="store_true", required=True)
        p.add_argument("--workdir", required=True)
        sys.exit(verify_command(p.parse_args().workdir))
    # A change of a built collection reads the config the index was built with unless --config is given.
    change = any(flag in sys.argv[1:] for flag in ("--add", "--remove", "--compact"))
    args, config = cli.parse(__doc__.splitlines()[0], _flags, config_from_workdir=change)
    if args.compile_only:
        from cfir_jax.aot.compile import compile_command

        return compile_command("index", config, args.topology)
    cli.maybe_initialize_distributed()
    from cfir_jax.commands import index
    from cfir_jax.index.runner import STAGES

    index.run(config, args.workdir, tuple(s for s in args.stages.split(",") if s) or STAGES, args.add_entities,
              {"add": args.add, "remove": args.remove, "compact": args.compact})


if __name__ == "__main__":
    main()
