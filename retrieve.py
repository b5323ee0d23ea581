"""Finds the images of a document with CFIR (entities -> candidate union -> summary re-ranking).

    python retrieve.py --index W --query doc.txt [--top-k 20] [--format table|json|trec] [--html out.html]
    python retrieve.py --index W --queries docs.jsonl --output run.trec [--qrels qrels.txt]
    python retrieve.py --index W --evaluate test [--compare]        # the corpus' own split; Table 3's rows
                                                                    # (+ the fused row when W/image_text exists,
                                                                    # + the re-ranked row when W/reranker does)
    python retrieve.py --index W --evaluate test --compare-k 1000,5000,10000,15000   # Table 4 from one index
    python retrieve.py --index W --evaluate test --compare-k 0,100,1000 --method cfir_bm25   # the same over BM25's M
    python retrieve.py --index W --evaluate validation --compare-k 0.5,1,2 --method cfir_bm25_fused   # its weight
    python retrieve.py --index W --fit-reranker                     # fit the third stage on the train split
    python retrieve.py --index W --serve [--host 127.0.0.1] [--port 8080]   # resident HTTP service (cfir_jax.serve)
    python retrieve.py --config configs/large.py --compile-only --topology v6e-8   # device SR, no TPU needed

Evaluation (--evaluate, --qrels) scores the candidate union exactly, as the paper does (retrieval.eval_sr="exact");
--config.retrieval.eval_sr=fast uses the fast scorer and prints its measured agreement with exact scoring.
"""

import sys

from cfir_jax.core import cli
from cfir_jax.core.cli import cli_main
from cfir_jax.core.errors import CfirError

# Hits shown on stdout (every --format alike): a screenful. Run files (--output) and --evaluate keep
# retrieval.top_k (1000) hits, since R@1000 and success@1000 need them.
SHOWN = 20


def _flags(p):
    # Not required by argparse: --compile-only (cli.parse's flag) stands alone; _check asks for one of them.
    what = p.add_mutually_exclusive_group()
    what.add_argument("--query", help="a plain-text document")
    what.add_argument("--queries", help='JSON lines {"id": ..., "text": ...}')
    what.add_argument("--evaluate", metavar="SPLIT", help="retrieve for the corpus' SPLIT topics and evaluate")
    what.add_argument("--fit-reranker", action="store_true", help="fit the re-ranker of SR's top-N "
                      "(retrieval.rerank) on the train split into W/reranker; enable it with "
                      "--config.retrieval.rerank.enabled=true")
    what.add_argument("--serve", action="store_true", help="serve the index over HTTP until stopped (POST "
                      "/v1/search, GET / a page; settings: --config.serve.*)")
    serving = p.add_argument_group("--serve")
    serving.add_argument("--host", default=None, help="address to listen on (default serve.host: 127.0.0.1)")
    serving.add_argument("--port", type=int, default=None, help="port (default serve.port: 8080; 0: any free one)")
    p.add_argument("--method", default="cfir", help="cfir | dense_document | dense_summary | entity_only | bm25 | "
                   "cfir_bm25 | cfir_bm25_fused")
    p.add_argument("--compare", action="store_true", help="with --evaluate: the rows of the paper's Table 3")
    p.add_argument("--plot", default="", metavar="FILE.png", help="with --evaluate: draw recall@k curves of the "
                   "method(s) into a PNG")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"hits to show and write, >= 1 (default: {SHOWN} on stdout in every --format; retrieval.top_k, "
                   "1000, in --output run files and --evaluate, which R@1000 needs)")
    p.add_argument("--format", default="table", help="table | json | trec (stdout)")
    p.add_argument("--html", default="", help="write an HTML page with the images")
    p.add_argument("--output", default="", help="write a TREC run file")
    p.add_argument("--qrels", default="", help="TREC qrels (or AToMiC parquet) to evaluate the run against")
    p.add_argument("--tag", default="cfir", help="run tag of TREC output")
    p.add_argument("--measures", default="", help="with --evaluate or --qrels: trec_eval (per text, trec_eval -c: "
                   "a judged topic without hits scores 0; the default), trec_eval_no_c (the mean over topics with "
                   "hits only, trec_eval without -c), authors (the authors' code: one query per qrels line, chunk "
                   "means) or both (trec_eval -c and authors); default retrieval.measures")
    p.add_argument("--compare-k", default="", metavar="K1,K2,...", help="with --evaluate: full CFIR at each K, the "
                   "paper's Table 4, from the one index (each a cut of its best-first lists, retrieval.k; refused "
                   "above the K it was built with); with --method cfir_bm25 each BM25's M (retrieval.lexical."
                   "candidates), with cfir_bm25_fused each fusion weight (retrieval.lexical.fuse_weight)")


def _check(args) -> None:
    from cfir_jax.retrieve.report import FORMATS

    chosen = [args.query, args.queries, args.evaluate, args.fit_reranker, args.serve, args.compile_only]
    if sum(bool(c) for c in chosen) != 1:
        raise CfirError("give exactly one of --query, --queries, --evaluate, --fit-reranker, --serve, --compile-only")

    if args.format not in FORMATS:
        raise CfirError(f"unknown format {args.format!r}: use table, json or trec")
    if args.plot and not args.evaluate:
        raise CfirError("--plot draws the recall curves of --evaluate SPLIT; add --evaluate")
    if args.plot:
        from cfir_jax.eval.plots import check_png_name

        check_png_name(args.plot)  # before minutes of retrieval, not after
    if args.top_k is not None and args.top_k < 1:
        raise CfirError(f"--top-k must be at least 1, got {args.top_k}")
    if args.compare_k and not args.evaluate:
        raise CfirError("--compare-k evaluates full CFIR at several K on --evaluate SPLIT; add --evaluate")
    if args.compare_k and args.method not in ("cfir", "cfir_bm25", "cfir_bm25_fused"):
        raise CfirError(f"--compare-k sweeps K (--method cfir), BM25's M (cfir_bm25) or its fusion weight "
                        f"(cfir_bm25_fused), not --method {args.method!r}")
    if args.compare_k and args.compare:
        raise CfirError("--compare (Table 3) and --compare-k (Table 4) are separate runs; give one")
    if args.compare_k:
        from cfir_jax.eval.comparison import parse_ks, parse_weights

        try:
            parse = {"cfir_bm25_fused": parse_weights, "cfir_bm25": lambda t: parse_ks(t, minimum=0)}
            args.compare_k = parse.get(args.method, parse_ks)(args.compare_k)
        except ValueError as e:
            raise CfirError(str(e)) from None


@cli_main
def main():
    args, config = cli.parse(__doc__.splitlines()[0], _flags, workdir_flag="--index", config_from_workdir=True,
                             check_args=_check, example="--config.retrieval.top_k=100")
    if args.compile_only:
        from cfir_jax.aot.compile import compile_command

        return compile_command("retrieve", config, args.topology)
    if args.top_k:
        config.retrieval.top_k = max(config.retrieval.top_k, args.top_k)
    top = args.top_k or config.retrieval.top_k
    from cfir_jax.eval.metrics import MEASURE_SETS

    measures = args.measures or config.retrieval.measures
    if measures not in MEASURE_SETS:
        raise CfirError(f"--measures {measures!r}: use one of {', '.join(MEASURE_SETS)}")
    if not args.serve:  # SIGTERM, to this process or its group (the entity workers ignore it): one line, exit 143
        from cfir_jax.core import faults

        faults.on_sigterm()
    if args.serve:
        from cfir_jax.commands import serve

        serve.run(config, args.index, args.config, sys.argv[1:], args.method, args.host, args.port)
    elif args.fit_reranker:
        from cfir_jax.retrieve.rerank_fit import fit_reranker, summary

        print(summary(fit_reranker(config, args.index), args.index))
    elif args.evaluate:
        from cfir_jax.commands import evaluate

        evaluate.run(config, args.index, args.evaluate, args.method, compare=args.compare, compare_k=args.compare_k,
                     plot=args.plot, output=args.output, tag=args.tag, top=top, measures=measures)
    else:
        from cfir_jax.commands import retrieve

        retrieve.run(config, args.index, args.method, query=args.query, queries=args.queries, fmt=args.format,
                     shown=args.top_k or min(SHOWN, top), top=top, html=args.html, output=args.output,
                     qrels=args.qrels, tag=args.tag, measures=measures)


if __name__ == "__main__":
    main()
