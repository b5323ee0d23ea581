"""The flags of index.py and retrieve.py, and retrieve.py's checks of them (run before any config is read). Light: it
loads no JAX, so a wrong flag of retrieve.py is answered at once."""

from __future__ import annotations

import argparse

from cfir_jax.core.config_check import MEASURE_SETS, SERVE_ENGINES
from cfir_jax.core.errors import CfirError
from cfir_jax.core.query_rule import check_facets, conditions
from cfir_jax.eval.comparison import parse_ks, parse_weights
from cfir_jax.eval.plots import check_png_name

# Hits shown on stdout (every --format alike): a screenful. Run files (--output) and --evaluate keep
# retrieval.top_k (1000) hits, since R@1000 and success@1000 need them.
SHOWN = 20
FORMATS = ("table", "json", "trec")


def verify_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`index.py --verify --workdir W`: a reader, with no config."""
    p = argparse.ArgumentParser(description="checks every store of W against its recorded checksums")
    p.add_argument("--verify", action="store_true", required=True)
    p.add_argument("--workdir", required=True)
    return p.parse_args(argv)


def index_flags(parser: argparse.ArgumentParser) -> None:
    # why: the stage names are read from the builders' source, none imported (--help loads no JAX)
    from cfir_jax.builders.descriptor import stages_unimported as stages

    parser.add_argument("--stages", default="", help="comma-separated subset of the stages to (re)build, of (in "
                        f"order): {', '.join(stages())}; default: all")
    parser.add_argument("--add-entities", default="", help="file of entity texts (one per line) to append")
    parser.add_argument("--add", default="", help="new documents and images to append to the built collection: a "
                        "directory (documents.jsonl|parquet, images.jsonl|parquet or images/, qrels/), a directory "
                        "of image files, or a .jsonl/.parquet file of image rows (docs/collection.md)")
    parser.add_argument("--remove", default="", help="file of image or document ids (one per line; image:ID or "
                        "document:ID where an id is both) that no method returns from now on")
    parser.add_argument("--compact", action="store_true", help="rewrite the stores without the removed image rows")
    parser.add_argument("--verify", action="store_true", help="re-read every store of --workdir against the "
                        "checksums recorded when it was built, name each damaged file, build nothing (exit 2 if any)")


def retrieve_flags(p: argparse.ArgumentParser) -> None:
    # Not required by argparse: --compile-only (cli.parse's flag) stands alone; check_retrieve asks for one of them.
    what = p.add_mutually_exclusive_group()
    what.add_argument("--query", help="a plain-text document")
    what.add_argument("--queries", help='JSON lines {"id": ..., "text": ...}')
    what.add_argument("--query-image", metavar="FILE", help="an image (JPEG, PNG, WebP, ...): its nearest images, "
                      "embedded by the index's own vision tower (docs/retrieval.md, search by image)")
    what.add_argument("--query-image-id", metavar="ID", help="an indexed image's id: its nearest images, by its "
                      "cached embedding")
    what.add_argument("--evaluate", metavar="SPLIT", help="retrieve for the corpus' SPLIT topics and evaluate")
    what.add_argument("--fit-reranker", action="store_true", help="fit the re-ranker of SR's top-N "
                      "(retrieval.rerank) on the train split into W/reranker; enable it with "
                      "--config.retrieval.rerank.enabled=true")
    what.add_argument("--fit-fusion", action="store_true", help="fit the convex fusions' weights on the train split "
                      "into W/convex_fusion: SR and BM25 (method cfir_bm25_convex), the image and its own text "
                      "(cfir_text_convex), each when its store exists; --compare then adds their rows")
    what.add_argument("--serve", action="store_true", help="serve the index over HTTP until stopped (POST "
                      "/v1/search, GET / a page; settings: --config.serve.*)")
    serving = p.add_argument_group("--serve")
    serving.add_argument("--host", default=None, help="address to listen on (default serve.host: 127.0.0.1)")
    serving.add_argument("--port", type=int, default=None, help="port (default serve.port: 8080; 0: any free one)")
    serving.add_argument("--engine", default=None, choices=sorted(SERVE_ENGINES), help="one process, or Ray Serve with "
                         "the index in shards and replicas (default serve.engine: local)")
    serving.add_argument("--address", default=None, help="with --engine ray: the Ray cluster to join (default "
                         "serve.address; none: start a local Ray)")
    p.add_argument("--method", default="cfir", help="cfir | dense_document | dense_summary | entity_only | bm25 | "
                   "cfir_bm25 | cfir_bm25_fused | cfir_bm25_convex | cfir_text_convex")
    p.add_argument("--compare", action="store_true", help="with --evaluate: the rows of the paper's Table 3")
    p.add_argument("--plot", default="", metavar="FILE.png", help="with --evaluate: draw recall@k curves of the "
                   "method(s) into a PNG")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"hits to show and write, >= 1 (default: {SHOWN} on stdout in every --format; retrieval.top_k, "
                   "1000, in --output run files and --evaluate, which R@1000 needs)")
    p.add_argument("--where", action="append", default=None, metavar="EXPR", help="only images whose own fields "
                   "pass EXPR: 'date<=2020-06-30', 'source=reuters', 'license in cc-by,cc0' (ops = != < <= > >= in); "
                   "repeat to AND them; with --query, --queries, --query-image(-id) and --evaluate (docs/filters.md)")
    p.add_argument("--facets", default=None, metavar="F1,F2", help="with --query, --queries and --query-image(-id): "
                   "count the values of these fields over every image the query ranked, the 20 largest of each "
                   "(a date by month; docs/filters.md)")
    p.add_argument("--fold-duplicates", action=argparse.BooleanOptionalAction, default=None, help="show each group "
                   "of near-duplicate images as its best-ranked one, the others listed under it (default: on for "
                   "--query/--queries shown on stdout and --query-image(-id); off with --output/--qrels and "
                   "--evaluate, so the measures count every image; docs/duplicates.md)")
    p.add_argument("--format", default="table", help="table | json | trec (stdout)")
    p.add_argument("--lang", default=None, metavar="CODE", help="with --query/--queries: the documents' language "
                   "(ISO 639-1: en, fr, ...; a --queries row's own \"lang\" wins); default: found where the collection "
                   "is not all English, else en (docs/languages.md)")
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
                   "above the K it was built with)")


def check_retrieve(args: argparse.Namespace) -> None:
    """retrieve.py's flags together, in one line each, before minutes of retrieval; --compare-k parsed to ints."""
    chosen = [args.query, args.queries, args.evaluate, args.fit_reranker, args.fit_fusion, args.serve,
              args.compile_only, args.query_image or args.query_image_id]
    if sum(bool(c) for c in chosen) != 1:
        raise CfirError("give exactly one of --query, --queries, --evaluate, --fit-reranker, --fit-fusion, --serve, "
                        "--compile-only, --query-image, --query-image-id")
    _check_image(args)
    if args.format not in FORMATS:
        raise CfirError(f"unknown format {args.format!r}: use table, json or trec")
    if args.plot and not args.evaluate:
        raise CfirError("--plot draws the recall curves of --evaluate SPLIT; add --evaluate")
    if args.plot:
        check_png_name(args.plot)
    # The filter lines parsed here, once: a malformed one is one line before minutes of loading; the commands carry
    # the Conditions (a field and a value's type are checked by the index, before its query runs).
    args.where = list(conditions(args.where)) or None
    if args.top_k is not None and args.top_k < 1:
        raise CfirError(f"--top-k must be at least 1, got {args.top_k}")
    if args.measures and args.measures not in MEASURE_SETS:
        raise CfirError(f"--measures {args.measures!r}: use one of {', '.join(MEASURE_SETS)}")
    if args.compare_k and not args.evaluate:
        raise CfirError("--compare-k evaluates full CFIR at several K on --evaluate SPLIT; add --evaluate")
    if args.compare_k and args.method not in ("cfir", "cfir_bm25", "cfir_bm25_fused"):
        raise CfirError(f"--compare-k sweeps K (--method cfir), BM25's M (cfir_bm25) or its fusion weight "
                        f"(cfir_bm25_fused), not --method {args.method!r}")
    if args.compare_k and args.compare:
        raise CfirError("--compare (Table 3) and --compare-k (Table 4) are separate runs; give one")
    if args.compare_k:
        parse = {"cfir_bm25_fused": parse_weights, "cfir_bm25": lambda t: parse_ks(t, minimum=0)}
        try:
            args.compare_k = parse.get(args.method, parse_ks)(args.compare_k)
        except ValueError as e:
            raise CfirError(str(e)) from None


def _check_image(args: argparse.Namespace) -> None:
    """An image's hits print on stdout: there is no run of documents to write or score, nor a document's language.
    --facets (parsed here) counts what a query ranked: a document's or an image's, not an evaluation's."""
    args.facets = list(check_facets(args.facets)) or None
    if args.facets and not (args.query or args.queries or args.query_image or args.query_image_id):
        raise CfirError("--facets counts what a query ranked: use it with --query, --queries or --query-image(-id)")
    if args.lang is not None and not (args.query or args.queries):
        raise CfirError("--lang states the language of --query or --queries documents; give one of them")
    if (args.query_image or args.query_image_id) and (args.output or args.qrels):
        raise CfirError("--output and --qrels write and score a run of documents; an image's hits print on stdout "
                        "(--format trec for TREC lines)")


def hit_budget(config, top_k: int | None) -> tuple[int, int]:
    """(hits kept in run files and evaluation, hits shown on stdout) for `--top-k` (None: not given); a larger
    --top-k raises retrieval.top_k so that retrieval keeps that many."""
    if top_k:
        config.retrieval.top_k = max(config.retrieval.top_k, top_k)
    top = top_k or config.retrieval.top_k
    return top, top_k or min(SHOWN, top)
