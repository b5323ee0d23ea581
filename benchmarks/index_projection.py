"""Per-stage throughput of index.py on this machine, and the projected wall time of AToMiC base and large on N hosts.

    python benchmarks/index_projection.py                          # measure every stage (~15 min on 2 cores)
    python benchmarks/index_projection.py --hosts 1,16,64 --sizes base
    python benchmarks/index_projection.py --stages entities,summaries
    python benchmarks/index_projection.py --rate image_cache=900 --rate summaries=35    # rates measured elsewhere

Every stage is measured the way index.py runs it, on one host (this machine), with the paper's models at their real
shapes and random weights (no downloads here; random weights cost the same FLOPs):
  corpus        AToMiC parquet (texts + images with ~30 KB JPEG bytes) -> the corpus format  [texts+images/s]
  image_cache   decode + BEiT-3 vision tower at 224 px, the full cache build                 [images/s]
  entities      spaCy NER (index.entities: en_core_web_sm) on 250-450-word documents         [documents/s]
  summaries     BART-large-CNN shape, CFIR's generation (4 beams, max 64 tokens) at --bart-input tokens [documents/s]
  entity_text   entity texts through the frozen BEiT-3 text tower at 16 tokens               [entities/s]
  entity_search ScaNN top-10,000 of each entity over the image cache                         [entities/s]

The projection (per setting, per host count N):

    T(N) = corpus_items / r_corpus  +  sum over s in the sharded stages of  items_s / (N * r_s)

The corpus conversion runs on process 0 alone (the other hosts wait); every other stage splits its items evenly over
the N processes (one per host), so it divides by N. Store assembly on process 0 (reading the per-process shards
back) and the start-up of each process (model loading, compiles) are left out: both are minutes, not days. ScaNN's
search rate depends on the cache size: it is measured at two sizes and extrapolated as a power law, r ~ n^-b.

Sizes. Large: 10,134,744 documents and 11,019,202 images (the AToMiC collections). Base: the images of the qrels,
11,019,202 - 7.6M = ~3.4M, and one document per qrel line of the three splits (4.4M + 17,801 + 9,873), an upper
bound. The number of entities indexed is not known before spaCy has run over the train documents: it is
--entities-per-doc (an assumption, 1.0 by default) times the documents. The printed table marks every figure as
measured, given (--rate) or projected.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
from common import REPO, hardware_description

STAGES = ("corpus", "image_cache", "entities", "summaries", "entity_text", "entity_search")
UNITS = {"corpus": "items/s", "image_cache": "images/s", "entities": "docs/s", "summaries": "docs/s",
         "entity_text": "entities/s", "entity_search": "entities/s"}
LARGE_DOCS, LARGE_IMAGES = 10_134_744, 11_019_202
BASE_DOCS, BASE_IMAGES = 4_400_000 + 17_801 + 9_873, 11_019_202 - 7_600_000


def _timed(fn, *args, **kwargs) -> tuple[object, float]:
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def _documents(n: int) -> list[str]:
    """n English-like documents of 250-450 words with named people, places and organisations (the synthetic world's
    generator: the length of an AToMiC section)."""
    from cfir_jax.data import synthetic

    cfg = synthetic.SyntheticConfig(num_entities=200, num_images=100, num_documents=n, num_topics=10, vocab_size=1000)
    return [d.text for d in synthetic.build_world(cfg).documents]


# ------------------------------------------------------------------------------------------------------- stages


def measure_corpus(args) -> float:
    """texts + images per second through the AToMiC parquet reader and the corpus writer (the large setting)."""
    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from atomic_fixtures import IMAGE_SCHEMA, QRELS_SCHEMA, TEXT_SCHEMA, _write
    from index_throughput import synthetic_jpegs

    from cfir_jax.data.atomic import build_atomic_corpus

    n = args.corpus_items
    docs = _documents(min(n, 200))
    jpegs = synthetic_jpegs(64, 500, 375)
    texts = [{"text_id": f"t{i}", "page_url": f"https://en.wikipedia.org/wiki/P{i}", "page_title": f"Page {i}",
              "section_title": "History", "context_page_description": docs[i % len(docs)][:600],
              "context_section_description": docs[i % len(docs)], "media": [f"i{i}"], "hierachy": ["History"],
              "category": ["Cat"], "source_id": f"s{i}"} for i in range(n)]
    images = [{"image_url": f"https://upload.wikimedia.org/i{i}.jpg", "image_id": f"i{i}", "language": ["en"],
               "caption_reference_description": [f"Caption {i}"], "caption_alt_text_description": [],
               "caption_attribution_description": [f"Attribution {i}"],
               "image": {"bytes": jpegs[i % len(jpegs)], "path": None}} for i in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for k in range(4):  # four parquet files each, as the hub's layout has many
            part = slice(k * n // 4, (k + 1) * n // 4)
            _write(root / "T" / "data" / f"train-0000{k}-of-00004-x.parquet", texts[part], TEXT_SCHEMA, 256)
            _write(root / "I" / "data" / f"train-0000{k}-of-00004-x.parquet", images[part], IMAGE_SCHEMA, 256)
        qrels = [{"text_id": f"t{i}", "Q0": "Q0", "image_id": f"i{i}", "rel": 1} for i in range(n)]
        _write(root / "Q" / "data" / "train-00000-of-00001-x.parquet", qrels, QRELS_SCHEMA)
        _, seconds = _timed(build_atomic_corpus, str(root / "T"), str(root / "I"), root / "Q", root / "out",
                            setting="large", splits=("train",))
    mb = sum(len(j) for j in jpegs) / len(jpegs) / 1e3
    print(f"  corpus: {n:,} texts + {n:,} images ({mb:.0f} KB JPEG each) converted in {seconds:.1f} s")
    return 2 * n / seconds


def measure_image_cache(args) -> float:
    """images/s of the full cache build (decode on threads + encode) with BEiT-3 `--model` at 224 px, float32."""
    from index_throughput import synthetic_jpegs

    from cfir_jax.builders.image_encoding import EncodeSettings, build_image_cache
    from cfir_jax.core.config import model_config
    from cfir_jax.data.corpus import Document, Image
    from cfir_jax.data.corpus_writer import write_corpus
    from cfir_jax.model.beit3 import create_model

    model = create_model(model_config(args.model, image_size=224))
    n, batch = args.cache_images, args.cache_batch
    data = synthetic_jpegs(n + batch, 500, 375)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        warm = write_corpus(tmp / "warm", "w", [Document("d0", "x")], (Image(f"w{k}", image=b)
                                                                         for k, b in enumerate(data[:batch])), {})
        _, compile_s = _timed(build_image_cache, tmp / "cache-warm", warm, model,
                              encoding=EncodeSettings(batch_size=batch), progress=False)
        corpus = write_corpus(tmp / "corpus", "b", [Document("d0", "x")], (Image(f"i{k}", image=b)
                                                                           for k, b in enumerate(data[batch:])), {})
        _, seconds = _timed(build_image_cache, tmp / "cache", corpus, model, encoding=EncodeSettings(batch_size=batch),
                            progress=False)
    print(f"  image_cache: BEiT-3 {args.model} at 224 px, {n} images (500x375 JPEG), batch {batch}: {seconds:.1f} s "
          f"(the first, compiling build of one batch took {compile_s:.1f} s)")
    return n / seconds


def measure_entities(args) -> float:
    """documents/s of spaCy NER as index.py runs it (nlp.pipe, or `--spacy-processes` entity workers: the
    entity_workers.index pool, `cfir_jax.nlp.entity_workers`)."""
    from cfir_jax.nlp.entities import EntityExtractor, load_spacy
    from cfir_jax.nlp.entity_workers import EntityWorkers, Settings

    docs = _documents(args.spacy_docs)
    workers = EntityWorkers("", "all", Settings(workers=args.spacy_processes)) if args.spacy_processes > 1 else None
    extractor = EntityExtractor(load_spacy(None), "all", batch_size=64, workers=workers)
    list(extractor.extract(docs[:16]))  # loads the pipeline's lazy parts
    found, seconds = _timed(lambda: list(extractor.extract(docs)))
    words = np.mean([len(d.split()) for d in docs])
    print(f"  entities: {len(docs)} documents of {words:.0f} words on average, {args.spacy_processes} process(es): "
          f"{seconds:.1f} s, {np.mean([len(f) for f in found]):.1f} entities per document")
    return len(docs) / seconds


def measure_summaries(args) -> float:
    """documents/s of BartSummarizer's generation at BART-large-CNN's shape, inputs of `--bart-input` tokens."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    sys.path[:0] = [str(REPO / "tests" / "helpers"), str(REPO / "tests" / "unit" / "nlp")]
    from test_summaries import _write_tiny_tokenizer

    from cfir_jax.nlp import bart as bart_lib
    from cfir_jax.nlp.bart_summarizer import BartSummarizer, published_config

    # facebook/bart-large-cnn's architecture (config.json of the hub model); random weights.
    config = published_config("facebook/bart-large-cnn")
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        bart_lib.save_bart(bart_lib.Bart(bart_lib.BartConfig.from_dict(config), jnp.float32, nnx.Rngs(0)),
                           Path(tmp), config)
        _write_tiny_tokenizer(tmp)
        summarizer = BartSummarizer(tmp, batch_size=args.bart_batch)
        created = time.perf_counter() - t
        b, length = args.bart_batch, args.bart_input
        rng = np.random.default_rng(0)
        mask = np.ones((b, length), np.int32)

        def batch() -> np.ndarray:
            ids = rng.integers(4, config.vocab_size, (b, length)).astype(np.int32)
            ids[:, 0], ids[:, -1] = 0, 2
            return ids

        _, compile_s = _timed(lambda: jax.block_until_ready(summarizer._generate(summarizer.model.params, batch(),
                                                                                 mask)))
        rounds = args.bart_rounds
        out, seconds = _timed(lambda: [np.asarray(summarizer._generate(summarizer.model.params, batch(), mask))
                                       for _ in range(rounds)])
    steps = np.mean([(o != config.pad_token_id).sum(1).mean() for o in out])
    print(f"  summaries: BART-large-CNN shape (created in {created:.0f} s), {rounds} batches of {b} x {length} input "
          f"tokens, 4 beams, {steps:.0f} tokens generated per summary (random weights run to max_length 64: an upper "
          f"bound): {seconds:.1f} s (compile {compile_s:.0f} s)")
    return rounds * b / seconds


def _text_tower(args):
    from cfir_jax.core.config import model_config
    from cfir_jax.model.beit3 import create_model
    from cfir_jax.model.text_encoder import TextEncoder

    model = create_model(model_config(args.model, image_size=224))
    stand_in = types.SimpleNamespace(vocab_size=model.config.vocab_size, path="-")  # ids are drawn, not tokenised
    return TextEncoder(model, stand_in, 16, batch_size=256)


def measure_entity_text(args) -> float:
    """entities/s through the frozen text tower at 16 tokens (index.entity_index.max_text_len)."""
    encoder = _text_tower(args)
    n = args.entity_texts
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 64000, (n, 16)).astype(np.int32)
    mask = np.zeros((n, 16), np.int32)  # no padding: the cost is the same whatever the entity's length
    encoder.encode_tokens(ids[:256], mask[:256])
    _, seconds = _timed(encoder.encode_tokens, ids, mask)
    print(f"  entity_text: {n} entity texts, BEiT-3 {args.model} text tower, 16 tokens: {seconds:.1f} s")
    return n / seconds


def search_rate(n_images: int, args) -> float:
    """entities/s of ScaNN top-K (the entity index's default configuration) over n_images clustered rows."""
    from cfir_jax.search.knn import ScannConfig, ScannSearcher, synthetic_embeddings

    db = synthetic_embeddings(n_images, args.dim, seed=0)
    queries = synthetic_embeddings(args.search_entities, args.dim, seed=1)
    searcher, build_s = _timed(ScannSearcher.build, db, args.k, ScannConfig())
    searcher.search(queries[:8], args.k)
    _, seconds = _timed(searcher.search, queries, args.k)
    print(f"  entity_search: {n_images:,} x {args.dim} images, K={args.k:,}, {args.search_entities} entities: "
          f"{seconds:.1f} s (ScaNN built in {build_s:.0f} s)")
    return args.search_entities / seconds


def measure_entity_search(args) -> tuple[float, float]:
    """(rate at --search-images' first size, exponent b of r ~ n^-b from the two sizes)."""
    n1, n2 = args.search_images
    r1, r2 = search_rate(n1, args), search_rate(n2, args)
    # A larger cache cannot make a query cheaper: a faster second run is noise, extrapolated as constant.
    b = max(0.0, math.log(r1 / r2) / math.log(n2 / n1))
    print(f"  entity_search: {r1:.0f} entities/s at {n1:,}, {r2:.0f} at {n2:,} images: rate ~ n^-{b:.2f}")
    return r1, b


# --------------------------------------------------------------------------------------------------- projection


def _duration(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 86400 * 2:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def setting_items(name: str, entities_per_doc: float) -> dict[str, float]:
    docs, images = (LARGE_DOCS, LARGE_IMAGES) if name == "large" else (BASE_DOCS, BASE_IMAGES)
    # Only the train documents' entities are indexed (the paper's protocol); the train split is ~all documents.
    entities = entities_per_doc * docs
    return {"corpus": docs + images, "image_cache": images, "entities": docs, "summaries": docs,
            "entity_text": entities, "entity_search": entities, "_images": images}


def stage_seconds(stage: str, items: dict[str, float], rates: dict, hosts: int, search: tuple[float, float, int]
                  ) -> float:
    if stage == "entity_search":
        r1, b, n1 = search
        rate = r1 * (n1 / items["_images"]) ** b
    else:
        rate = rates[stage]
    return items[stage] / (rate * (1 if stage == "corpus" else hosts))


def print_projection(rates: dict[str, float], origin: dict[str, str], search: tuple[float, float, int],
                     args) -> None:
    print("\n| stage | rate per host | source | " + " | ".join(
        f"{s} on {h} host{'s' * (h > 1)}" for s in args.sizes for h in args.hosts) + " |")
    print("|---|---|---|" + "---|" * (len(args.sizes) * len(args.hosts)))
    totals = {(s, h): 0.0 for s in args.sizes for h in args.hosts}
    for stage in STAGES:
        if stage not in rates:
            continue
        cells = []
        for s in args.sizes:
            items = setting_items(s, args.entities_per_doc)
            for h in args.hosts:
                sec = stage_seconds(stage, items, rates, h, search)
                totals[(s, h)] += sec
                cells.append(_duration(sec))
        rate = f"{rates[stage]:,.1f} {UNITS[stage]}"
        if stage == "entity_search":
            rate += f" at {search[2]:,} images, ~n^-{search[1]:.2f}"
        print(f"| {stage} | {rate} | {origin[stage]} | " + " | ".join(cells) + " |")
    print("| **total** | | projected | " + " | ".join(_duration(totals[(s, h)]) for s in args.sizes
                                                     for h in args.hosts) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of: {', '.join(STAGES)}")
    p.add_argument("--hosts", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    p.add_argument("--sizes", type=lambda s: s.split(","), default=["base", "large"], help="AToMiC settings")
    p.add_argument("--rate", action="append", default=[], help="STAGE=RATE: a rate measured elsewhere (skips it)")
    p.add_argument("--model", default="large", help="BEiT-3 size of the frozen encoder (CFIR-L: large)")
    p.add_argument("--corpus-items", type=int, default=2000)
    p.add_argument("--cache-images", type=int, default=64)
    p.add_argument("--cache-batch", type=int, default=16)
    p.add_argument("--spacy-docs", type=int, default=300)
    p.add_argument("--spacy-processes", type=int, default=1)
    p.add_argument("--bart-input", type=int, default=512, help="input tokens per document")
    p.add_argument("--bart-batch", type=int, default=8)
    p.add_argument("--bart-rounds", type=int, default=2)
    p.add_argument("--entity-texts", type=int, default=2048)
    p.add_argument("--search-images", type=lambda s: [int(x) for x in s.split(",")], default=[100_000, 400_000])
    p.add_argument("--search-entities", type=int, default=512)
    p.add_argument("--dim", type=int, default=1024, help="embedding dim (large: 1024)")
    p.add_argument("--k", type=int, default=10_000, help="the paper's entity top-K")
    p.add_argument("--entities-per-doc", type=float, default=1.0,
                   help="assumed new unique entities per train document (spaCy's count is not known in advance)")
    args = p.parse_args()
    stages = [s for s in args.stages.split(",") if s]
    unknown = set(stages) - set(STAGES)
    if unknown:
        p.error(f"--stages: unknown {sorted(unknown)}; use {', '.join(STAGES)}")
    if len(args.search_images) != 2 or args.search_images[0] >= args.search_images[1]:
        p.error("--search-images: two increasing sizes")
    rates, origin = {}, {}
    search = (0.0, 0.0, args.search_images[0])
    for item in args.rate:
        stage, _, value = item.partition("=")
        if stage not in STAGES:
            p.error(f"--rate {item}: unknown stage {stage!r}")
        rates[stage], origin[stage] = float(value), "given"
        if stage == "entity_search":
            search = (float(value), 0.5, args.search_images[0])
    print(f"hardware: {hardware_description()}; load before: {open('/proc/loadavg').read().split()[0]}")
    measures = {"corpus": measure_corpus, "image_cache": measure_image_cache, "entities": measure_entities,
                "summaries": measure_summaries, "entity_text": measure_entity_text}
    for stage in stages:
        if stage in rates:
            continue
        if stage == "entity_search":
            r1, b = measure_entity_search(args)
            rates[stage], search = r1, (r1, b, args.search_images[0])
        else:
            rates[stage] = measures[stage](args)
        origin[stage] = "measured"
    print(f"load after: {open('/proc/loadavg').read().split()[0]}")
    print(f"\nT(N) = corpus_items / r_corpus + sum_s items_s / (N * r_s); model {args.model}, "
          f"{args.entities_per_doc} indexed entities per document (assumed), documents base {BASE_DOCS:,} "
          f"(upper bound) / large {LARGE_DOCS:,}, images base ~{BASE_IMAGES:,} / large {LARGE_IMAGES:,}")
    print_projection(rates, origin, search, args)


if __name__ == "__main__":
    main()
