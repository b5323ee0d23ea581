"""Finds the images of a document with CFIR (entities -> candidate union -> summary re-ranking).

    python retrieve.py --index W --query doc.txt [--top-k 20] [--format table|json|trec] [--html out.html]
    python retrieve.py --index W --queries docs.jsonl --output run.trec [--qrels qrels.txt]
    python retrieve.py --index W --evaluate test [--compare]        # the corpus' own split; Table 3's rows
                                                                    # (+ the fused row when W/image_text exists,
                                                                    # + the re-ranked row when W/reranker does)
    python retrieve.py --index W --fit-reranker                     # fit the third stage on the train split
    python retrieve.py --config configs/large.py --compile-only --topology v6e:2x4   # device SR, no TPU needed

Evaluation (--evaluate, --qrels) scores the candidate union exactly, as the paper does (retrieval.eval_sr="exact");
--config.retrieval.eval_sr=fast uses the fast scorer and prints its measured agreement with exact scoring.
"""

import argparse
import sys

from cfir_jax.errors import CfirError, cli_main

# Hits shown on stdout (every --format alike): a screenful. Run files (--output) and --evaluate keep
# retrieval.top_k (1000) hits, since R@1000 and success@1000 need them.
SHOWN = 20


def _args(argv=None):
    from cfir_jax.cli import overrides_help

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="The config is the index's own (W/index.json) unless --config is given. "
                                + overrides_help("--config.retrieval.top_k=100"))
    p.add_argument("--index", help="workdir built by index.py (and train.py)")
    p.add_argument("--config", default="", help="config file; default: the config the index was built with")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--query", help="a plain-text document")
    what.add_argument("--queries", help='JSON lines {"id": ..., "text": ...}')
    what.add_argument("--evaluate", metavar="SPLIT", help="retrieve for the corpus' SPLIT topics and evaluate")
    what.add_argument("--compile-only", action="store_true", help="compile the device SR for --topology (with "
                      "--config; no TPU needed, no index read) and print each device's memory")
    p.add_argument("--topology", default="", help="with --compile-only: a TPU topology, e.g. v5e:2x4 or v6e-8")
    what.add_argument("--fit-reranker", action="store_true", help="fit the re-ranker of SR's top-N "
                      "(retrieval.rerank) on the train split into W/reranker; enable it with "
                      "--config.retrieval.rerank.enabled=true")
    p.add_argument("--method", default="cfir", help="cfir | dense_document | dense_summary | entity_only")
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
    return p.parse_known_args(argv)


@cli_main
def main():
    args, overrides = _args()
    from cfir_jax import cli
    from cfir_jax.retrieve import report

    if args.compile_only:
        if not args.config:
            raise CfirError("--compile-only needs --config (configs/base.py or configs/large.py)")
        from cfir_jax.aot.compile import compile_command

        return compile_command("retrieve", cli.apply_overrides(cli.load_config_file(args.config), overrides),
                               args.topology)
    if not args.index:
        raise CfirError("--index W is required: the workdir built by index.py")

    if args.format not in report.FORMATS:
        raise CfirError(f"unknown format {args.format!r}: use table, json or trec")
    if args.plot and not args.evaluate:
        raise CfirError("--plot draws the recall curves of --evaluate SPLIT; add --evaluate")
    if args.plot:
        from cfir_jax.eval.plots import check_png_name

        check_png_name(args.plot)  # before minutes of retrieval, not after
    if args.top_k is not None and args.top_k < 1:
        raise CfirError(f"--top-k must be at least 1, got {args.top_k}")
    config = cli.load_config_file(args.config) if args.config else cli.workdir_config(args.index)
    _add_new_retrieval_fields(config)
    config = cli.apply_overrides(config, overrides)
    if args.top_k:
        config.retrieval.top_k = max(config.retrieval.top_k, args.top_k)
    top = args.top_k or config.retrieval.top_k
    shown = args.top_k or min(SHOWN, top)

    if args.fit_reranker:
        return _fit_reranker(config, args)
    if args.evaluate:
        return _evaluate(config, args, top)
    from cfir_jax.retrieve.pipeline import Retriever, run_of
    from cfir_jax.retrieve.queries import read_queries, read_query

    docs = [read_query(args.query)] if args.query else read_queries(args.queries)
    if args.qrels:
        _evaluation_sr(config)
    retriever = Retriever(config, args.index, args.method, measure_agreement=bool(args.qrels))
    _print_notes(retriever)
    results = retriever.retrieve_many(docs, progress=len(docs) > 1)
    describe = retriever.describe_image
    for doc, result in zip(docs, results):
        if args.format == "table":
            print(report.table(result, describe, shown))
        elif args.format == "json":
            print(report.as_json(doc.doc_id, result, describe, shown))
        else:
            print(report.trec_lines(doc.doc_id, result, args.tag, shown))
    if args.html:
        from pathlib import Path

        row = {i: n for n, i in enumerate(retriever.corpus.image_ids)}
        image_bytes = lambda image_id: retriever.corpus.image(row[image_id]).image if image_id in row else b""  # noqa
        page = "".join(report.html_page(d.doc_id, r, describe, image_bytes, shown) for d, r in zip(docs, results))
        Path(args.html).write_text(page)
        print(f"wrote {args.html}", file=sys.stderr)
    run = run_of(results, docs)
    _write_and_score(run, args, top)
    if args.qrels:
        if args.method in ("cfir", "entity_only"):
            print(report.unknown_summary(results, config.retrieval.unknown_entities))
        print(report.sr_line(config.retrieval, [results]))


def _write_and_score(run, args, top):
    from cfir_jax.eval import metrics, trec

    if args.output:
        trec.write_run(args.output, run, tag=args.tag, max_hits=top)
        print(f"wrote {args.output}", file=sys.stderr)
    if args.qrels:
        print(metrics.evaluate(run, trec.read_qrels(args.qrels)).table())


def _add_new_retrieval_fields(config) -> None:
    """A workdir's recorded config predates retrieval fields added since (fusion, rerank): they take their defaults,
    so that --config.retrieval.rerank.enabled=true works on an index built before the field existed."""
    from cfir_jax.config import retrieval_config

    for key, value in retrieval_config().items():
        if key not in config.retrieval:
            config.retrieval[key] = value


def _fit_reranker(config, args) -> None:
    from cfir_jax.retrieve.rerank_fit import fit_reranker

    m = fit_reranker(config, args.index)
    print(f"re-ranker: {m['lists_kept']:,} of {m['train_documents']:,} train documents have a positive in SR's top "
          f"{m['top_n']} ({m['lists_skipped']:,} skipped); features {', '.join(m['features'])}")
    print(f"held-out lists: {m['heldout_lists']:,}, MRR@10 within the top {m['top_n']}: SR {m['heldout_sr_mrr10']:.4f}"
          f" -> re-ranked {m['heldout_mrr10']:.4f} (best epoch {m['best_epoch']} of {m['epochs_run']}); "
          f"{m['fit_seconds']:.1f} s")
    print(f"wrote {args.index.rstrip('/')}/reranker; use it with --config.retrieval.rerank.enabled=true "
          "(--compare adds its row)")


def _print_notes(retriever) -> None:
    for note in retriever.notes:
        print(f"note: {note}", file=sys.stderr)


def _evaluation_sr(config) -> None:
    """Evaluation scores with retrieval.eval_sr (exact unless asked otherwise), whatever retrieval.sr says."""
    config.retrieval.sr = config.retrieval.get("eval_sr", "exact")


def _evaluate(config, args, top):
    from cfir_jax.eval import metrics, plots
    from cfir_jax.retrieve import report
    from cfir_jax.retrieve.pipeline import Retriever, run_of

    _evaluation_sr(config)
    rows = report.TABLE3_ROWS if args.compare else ((args.method, args.method, {}),)
    if args.compare:
        from cfir_jax.layout import Layout

        # The paper's rows stay the paper's whatever retrieval.fusion, entity_text_match and rerank say; the rows
        # beyond the paper come after them.
        paper = dict(w_img=1.0, w_txt=0.0, compare_w_txt=0.0)
        no_rerank = {**config.retrieval.rerank.to_dict(), "enabled": False}
        plain = {"rerank": no_rerank, "entity_text_match": False}
        rows = tuple((label, method, {**o, "fusion": paper, **plain}) for label, method, o in rows)
        layout = Layout.of(args.index)
        if (layout.image_text / "manifest.json").is_file():  # index.py built the image text
            label, method, overrides = report.fused_row(config.retrieval)
            rows += ((label, method, {**overrides, **plain}),)
        if (layout.entity_text_match / "manifest.json").is_file():
            label, method, overrides = report.TEXT_MATCH_ROW
            rows += ((label, method, {**overrides, "rerank": no_rerank}),)
        if (layout.reranker / "manifest.json").is_file() or config.retrieval.rerank.enabled:
            rows += tuple((label, method, {**o, "entity_text_match": False})
                          for label, method, o in report.rerank_rows(config.retrieval))
    table, all_results, curves = [], [], {}
    unknown_line = ""
    for label, method, retrieval_overrides in rows:
        row_config = config.copy_and_resolve_references()
        row_config.retrieval.update(retrieval_overrides)
        retriever = Retriever(row_config, args.index, method, measure_agreement=True)
        _print_notes(retriever)
        docs = retriever.corpus_documents(args.evaluate)
        results = retriever.retrieve_many(docs, progress=True)
        if method in ("cfir", "entity_only") and not unknown_line:  # the same entities for both methods
            unknown_line = report.unknown_summary(results, row_config.retrieval.unknown_entities)
        all_results.append(results)
        run = run_of(results, docs)
        qrels = retriever.corpus.qrels(args.evaluate)
        if args.plot:
            curves[label] = plots.recall_curve(run, qrels)
        res = metrics.evaluate(run, qrels, measures=report.EVAL_MEASURES)
        table.append(report.EvalRow(label, res.aggregate, results, retriever.model_used))
        if len(rows) == 1:
            args.qrels = ""
            _write_and_score(run, args, top)
    print(f"{args.evaluate} split, {len(docs)} topics")
    print(report.eval_table(table))
    print(report.sr_line(config.retrieval, all_results))
    if report.rerank_line(table):
        print(report.rerank_line(table))
    if unknown_line:
        print(unknown_line)
    if args.plot:
        plots.plot_recall_curves(curves, args.plot, f"{args.evaluate} split, {len(docs)} topics")
        print(f"wrote {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
