"""The three commands' entry points: `index_main`, `train_main` and `retrieve_main`, run by the scripts `index.py`,
`train.py` and `retrieve.py` at the repository's root and by the console scripts `cfir-index`, `cfir-train` and
`cfir-retrieve` that pip installs (pyproject.toml's [project.scripts]): one function per command, each parsing its
flags and calling one `run` of its body. Each function's docstring is the command's usage (its first line the
--help description)."""

import gc
import sys

from cfir_jax.commands import flags
from cfir_jax.core import cli, faults, memory
from cfir_jax.core.cli import cli_main
from cfir_jax.nlp import entity_workers


@cli_main
def index_main():
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

    On several hosts, run the same command on every host (jax.distributed: see cfir_jax/builders/runner.py).
    """
    if "--verify" in sys.argv[1:]:  # a reader: no config, no lock, no JAX
        # why: each command loads only its own stack (the verifier: numpy; a build: JAX, flax, spaCy)
        from cfir_jax.commands import verify

        sys.exit(verify.run(flags.verify_args().workdir))
    # A change of a built collection reads the config the index was built with unless --config is given.
    change = any(flag in sys.argv[1:] for flag in ("--add", "--remove", "--compact"))
    args, config = cli.parse(index_main.__doc__.splitlines()[0], flags.index_flags, config_from_workdir=change)
    if args.compile_only:
        # why: libtpu's compiler loads only for --compile-only
        from cfir_jax.commands import compile_only

        return compile_only.run("index", config, args.topology)
    memory.reuse_freed_memory()  # the pretraining's and the encoders' steps reuse one scratch space (before JAX)
    cli.maybe_initialize_distributed()
    # why: the builders (JAX, flax, spaCy) load once the flags and the config are read
    from cfir_jax.commands import build

    build.run(config, args.workdir, tuple(s for s in args.stages.split(",") if s), args.add_entities,
              {"add": args.add, "remove": args.remove, "compact": args.compact})


@cli_main
def train_main():
    """Trains CFIR's language expert on (summary, image) pairs of the index in --workdir.

        python train.py --config configs/large.py --workdir W --config.init_model=...   # see README for GPU/TPU
        python train.py --config configs/demo.py --workdir demo_work
        python train.py --config configs/demo.py:full --workdir demo_work       # D-BEiT-3 Full: both towers, pixels
        python train.py --config configs/large.py --compile-only --topology v5p:4x4x4   # TPU programs, no TPU needed
    """
    args, config = cli.parse(train_main.__doc__.splitlines()[0])
    if args.compile_only:
        # why: libtpu's compiler loads only for --compile-only
        from cfir_jax.commands import compile_only

        return compile_only.run("train", config, args.topology)
    memory.reuse_freed_memory()  # each step reuses the last one's scratch space (before JAX starts its threads)
    cli.maybe_initialize_distributed()
    # why: JAX, flax and orbax load once the flags and the config are read
    from cfir_jax.commands import train

    train.run(config, args.workdir)


@cli_main
def retrieve_main():
    """Finds the images of a document with CFIR (entities -> candidate union -> summary re-ranking).

        python retrieve.py --index W --query doc.txt [--top-k 20] [--format table|json|trec] [--html out.html]
        python retrieve.py --index W --queries docs.jsonl --output run.trec [--qrels qrels.txt]
        python retrieve.py --index W --query-image photo.jpg [--top-k 20] [--format table|json|trec]   # by image
        python retrieve.py --index W --query-image-id IMAGE_ID          # the nearest images of an indexed image
        python retrieve.py --index W --evaluate test [--compare]        # the corpus' own split; Table 3's rows (+ the
                                                                        # fused, re-ranked rows: W/image_text, reranker)
        python retrieve.py --index W --evaluate test --compare-k 1000,5000,10000,15000   # Table 4 from one index
        python retrieve.py --index W --fit-reranker                     # fit the third stage on the train split
        python retrieve.py --index W --fit-fusion                       # fit the convex fusions (BM25, image text)
        python retrieve.py --index W --serve [--host 127.0.0.1] [--port 8080]   # resident HTTP service (cfir_jax.serve)
        python retrieve.py --config configs/large.py --compile-only --topology v6e-8   # device SR, no TPU needed

    Evaluation (--evaluate, --qrels) scores the candidate union exactly, as the paper does (retrieval.eval_sr="exact");
    --config.retrieval.eval_sr=fast uses the fast scorer and prints its measured agreement with exact scoring.
    """
    # One document, then the process ends: Python's cyclic collector would only scan the start's objects (JAX's, the
    # model's, a million of them) again and again, a tenth of a second of a second query. Every other use collects.
    gc.disable()
    args, config = cli.parse(retrieve_main.__doc__.splitlines()[0], flags.retrieve_flags, workdir_flag="--index",
                             config_from_workdir=True, check_args=flags.check_retrieve,
                             example="--config.retrieval.top_k=100")
    if not args.query:
        gc.enable()
    if args.compile_only or args.serve:
        return _compile_only_or_serve(args, config)
    memory.reuse_freed_memory()  # the fits', the evaluation's and the bulk run's encoders: one scratch space
    if args.query_image or args.query_image_id:
        return _retrieve_by_image(args, config)
    faults.on_sigterm()  # SIGTERM, to this process or its group (the entity workers ignore it): one line, exit 143
    top, shown = flags.hit_budget(config, args.top_k)
    measures = args.measures or config.retrieval.measures
    if args.fit_reranker or args.fit_fusion:
        # why: each body loads its own stack (JAX, flax, spaCy; optax for a fit) once the flags and config are read
        from cfir_jax.commands import fit_fusion, fit_reranker

        (fit_reranker if args.fit_reranker else fit_fusion).run(config, args.index)
    elif args.evaluate:
        # why: the evaluation's stack (metrics, plots, its tables) loads only for --evaluate
        from cfir_jax.commands import evaluate

        topics = evaluate.Topics(args.evaluate, args.where, bool(args.fold_duplicates))
        reporting = evaluate.Reporting(measures, args.plot, args.output, args.tag, top)
        evaluate.run(config, args.index, topics, args.method, compare=args.compare, compare_k=args.compare_k,
                     reporting=reporting)
    else:
        if args.query and _reads_entities(args.method):  # spaCy loads in a worker beside JAX, models, programs
            e = config.index.entities
            entity_workers.start(e.spacy_model, e.labels, entity_workers.Settings.of(config, "query"))
        # why: a query run loads the Retriever's stack, not the evaluation's or the fit's
        from cfir_jax.commands import retrieve

        asked = retrieve.Asked(args.query, args.queries, args.lang, args.where, args.fold_duplicates,
                               args.facets)
        retrieve.run(config, args.index, args.method, asked, retrieve.Shown(args.format, shown, args.html, args.tag),
                     retrieve.RunFile(args.output, args.qrels, top, measures))


def _compile_only_or_serve(args, config):
    """retrieve.py --compile-only (device SR for a TPU topology) or --serve (the resident service, which stops on
    SIGTERM by itself, answering what it accepted)."""
    if args.compile_only:
        # why: libtpu's compiler loads only for --compile-only
        from cfir_jax.commands import compile_only

        return compile_only.run("retrieve", config, args.topology)
    # why: FastAPI and uvicorn load only for --serve
    from cfir_jax.commands import serve

    return serve.run(config, args.index, config_spec=args.config, argv=sys.argv[1:], method=args.method,
                     placement=serve.Placement(args.engine, args.host, args.port, args.address))


def _reads_entities(method: str) -> bool:
    """Whether retrieval's `method` parses the query's entities (an unknown name: no, its error comes later); the
    methods' table loads no JAX, so this is read before JAX loads."""
    # why: the methods' table (numpy) loads only for a query
    from cfir_jax.retrieve.methods import METHODS

    return method in METHODS and bool(METHODS[method].uses_entities)


def _retrieve_by_image(args, config) -> None:
    """`--query-image FILE` / `--query-image-id ID`: the image's nearest images, shown as `--query`'s hits."""
    # why: the Retriever's stack and the vision tower load once the flags and the config are read
    from cfir_jax.commands import retrieve_image
    from cfir_jax.commands.retrieve import Shown
    from cfir_jax.core.query_rule import Query

    faults.on_sigterm()
    shown = flags.hit_budget(config, args.top_k)[1]
    query = Query(image=args.query_image or None, image_id=args.query_image_id or None,
                  method=args.method, top_k=shown, where=args.where, fold=args.fold_duplicates is not False,
                  facets=args.facets)
    retrieve_image.run(config, args.index, query, Shown(args.format, shown, args.html, args.tag))
