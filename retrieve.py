"""Finds the images of a document with CFIR (entities -> candidate union -> summary re-ranking).

    python retrieve.py --index W --query doc.txt [--top-k 20] [--format table|json|trec] [--html out.html]
    python retrieve.py --index W --queries docs.jsonl --output run.trec [--qrels qrels.txt]
    python retrieve.py --index W --evaluate test [--compare]        # the corpus' own split; Table 3's rows
                                                                    # (+ the fused row when W/image_text exists,
                                                                    # + the re-ranked row when W/reranker does)
    python retrieve.py --index W --evaluate test --compare-k 1000,5000,10000,15000   # Table 4 from one index
    python retrieve.py --index W --fit-reranker                     # fit the third stage on the train split
    python retrieve.py --index W --serve [--host 127.0.0.1] [--port 8080]   # resident HTTP service (cfir_jax.serve)
    python retrieve.py --config configs/large.py --compile-only --topology v6e-8   # device SR, no TPU needed

Evaluation (--evaluate, --qrels) scores the candidate union exactly, as the paper does (retrieval.eval_sr="exact");
--config.retrieval.eval_sr=fast uses the fast scorer and prints its measured agreement with exact scoring.
"""

import sys

from cfir_jax.commands import flags
from cfir_jax.core import cli, faults
from cfir_jax.core.cli import cli_main


@cli_main
def main():
    args, config = cli.parse(__doc__.splitlines()[0], flags.retrieve_flags, workdir_flag="--index",
                             config_from_workdir=True, check_args=flags.check_retrieve,
                             example="--config.retrieval.top_k=100")
    if args.compile_only:
        # why: libtpu's compiler loads only for --compile-only
        from cfir_jax.commands import compile_only

        return compile_only.run("retrieve", config, args.topology)
    if args.serve:  # the service stops on SIGTERM by itself, answering what it accepted
        # why: FastAPI and uvicorn load only for --serve
        from cfir_jax.commands import serve

        return serve.run(config, args.index, config_spec=args.config, argv=sys.argv[1:], method=args.method,
                         host=args.host, port=args.port, engine=args.engine, address=args.address)
    faults.on_sigterm()  # SIGTERM, to this process or its group (the entity workers ignore it): one line, exit 143
    top, shown = flags.hit_budget(config, args.top_k)
    measures = args.measures or config.retrieval.measures
    if args.fit_reranker:
        # why: each body loads its own stack (JAX, flax, spaCy; optax for a fit) once the flags and config are read
        from cfir_jax.commands import fit_reranker

        fit_reranker.run(config, args.index)
    elif args.evaluate:
        # why: the evaluation's stack (metrics, plots, its tables) loads only for --evaluate
        from cfir_jax.commands import evaluate

        evaluate.run(config, args.index, args.evaluate, args.method, compare=args.compare, compare_k=args.compare_k,
                     plot=args.plot, output=args.output, tag=args.tag, top=top, measures=measures)
    else:
        # why: a query run loads the Retriever's stack, not the evaluation's or the fit's
        from cfir_jax.commands import retrieve

        retrieve.run(config, args.index, args.method, query=args.query, queries=args.queries, fmt=args.format,
                     shown=shown, top=top, html=args.html, output=args.output, qrels=args.qrels, tag=args.tag,
                     measures=measures)


if __name__ == "__main__":
    main()
