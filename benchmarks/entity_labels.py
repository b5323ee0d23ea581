"""How the entity label set changes ER: entities per document, candidate union sizes, and the relevant images the
union holds, for every spaCy label (the paper's, the default) against the 11 picturable labels (the option).

    python benchmarks/entity_labels.py --workdir demo_work            # a workdir built by index.py (any label set)
    python benchmarks/entity_labels.py --atomic-fixture /tmp/fx      # builds the tests' AToMiC-layout fixture there

For each topic of `--split` (default test) both label sets extract the document's entities; each entity's candidate
list is its exact top-K over the image cache by the frozen index encoder (K = the workdir's index.entity_index.k,
clamped to the cache), which is what ER gives with `retrieval.unknown_entities=search` and an exact index; the union
is deduplicated. Printed per label set: topics, entities per topic, topics without an entity, union size (mean,
median, max), and the union's recall of the judged images (R@union, the ceiling SR can reach). The labels the
filter drops are counted by type.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LABEL_SETS = ("all", "picturable")


def build_atomic_fixture(root: Path) -> Path:
    """The AToMiC-layout fixture of tests/e2e/test_index.py (six texts, ten images, three qrels splits) indexed with the
    tests' tiny random encoder and the default config; returns the workdir."""
    sys.path[:0] = [str(REPO / "tests" / "helpers"), str(REPO / "tests" / "e2e")]
    from test_index import write_inputs

    from cfir_jax.data.synthetic import SyntheticConfig, build_world, train_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    spm = root / "synthetic.spm"
    if not spm.is_file():
        world = build_world(SyntheticConfig.tiny())
        train_tokenizer([d.text for d in world.documents] + [i.caption for i in world.images], spm,
                        SyntheticConfig.tiny().vocab_size)
    _, config = write_inputs(root, spm)
    subprocess.run([sys.executable, "index.py", "--config", str(config), "--workdir", str(root / "W")], cwd=REPO,
                   check=True, capture_output=True, text=True)
    return root / "W"


def measure(workdir: Path, split: str) -> None:
    from cfir_jax.builders.index_encoder import entity_encoder
    from cfir_jax.core.cli import workdir_config
    from cfir_jax.data.corpus import Corpus
    from cfir_jax.nlp.entities import EntityExtractor, load_spacy
    from cfir_jax.search.topk import exact_topk
    from cfir_jax.stores.image_cache import ImageCache
    from cfir_jax.stores.layout import Layout

    config = workdir_config(workdir)
    layout = Layout.of(workdir)
    corpus = Corpus.open(layout.corpus)
    cache = ImageCache.open(layout.image_cache)
    qrels = corpus.qrels(split)
    row_of_doc = {d: i for i, d in enumerate(corpus.doc_ids)}
    topics = [t for t in qrels if t in row_of_doc]
    texts = [corpus.document(row_of_doc[t]).text for t in topics]
    row_of_image = {image_id: i for i, image_id in enumerate(cache.ids)}
    k = min(int(config.index.entity_index.k), len(cache.ids))
    encoder, _ = entity_encoder(config, layout, corpus)
    nlp = load_spacy(config.index.entities.spacy_model or None)
    print(f"{workdir}: {split} split, {len(topics)} topics; cache {len(cache.ids):,} x {cache.embeddings.shape[1]}; "
          f"K = {k:,} (exact top-K per entity)")

    found = {}
    for labels in LABEL_SETS:
        extractor = EntityExtractor(nlp, labels, batch_size=64)
        found[labels] = list(extractor.extract(texts))
    # Labels of what the filter drops, from one more pass that keeps the spans' types.
    dropped = collections.Counter()
    picturable = set(EntityExtractor(nlp, "picturable").labels)
    for doc in nlp.pipe(texts, batch_size=64):
        dropped.update(ent.label_ for ent in doc.ents if ent.label_ not in picturable)

    print(f"{'labels':<11} {'entities/topic':>14} {'no entity':>9} {'union mean':>10} {'median':>7} {'max':>7} "
          f"{'R@union':>8}")
    for labels in LABEL_SETS:
        names = sorted({e for ents in found[labels] for e in ents})
        lists = {}
        if names:
            _, idx = exact_topk(encoder.encode(names), cache.embeddings, k)
            lists = dict(zip(names, idx))
        sizes, hits, judged = [], 0, 0
        for topic, ents in zip(topics, found[labels]):
            union = set(np.concatenate([lists[e] for e in ents]).tolist()) if ents else set()
            sizes.append(len(union))
            relevant = [row_of_image[i] for i, rel in qrels[topic].items() if rel > 0 and i in row_of_image]
            hits += sum(r in union for r in relevant)
            judged += len(relevant)
        sizes = np.asarray(sizes)
        per_topic = np.mean([len(e) for e in found[labels]])
        empty = sum(1 for e in found[labels] if not e)
        recall = hits / judged if judged else float("nan")
        print(f"{labels:<11} {per_topic:>14.2f} {empty:>9} {sizes.mean():>10.1f} {np.median(sizes):>7.0f} "
              f"{sizes.max():>7} {recall:>8.4f}")
    kinds = ", ".join(f"{label} {n}" for label, n in dropped.most_common()) or "none"
    print(f"mentions the 11-label filter drops, by type: {kinds}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--workdir", type=Path, help="a workdir built by index.py")
    group.add_argument("--atomic-fixture", type=Path, help="build the tests' AToMiC-layout fixture here, then measure")
    parser.add_argument("--split", default="test", help="qrels split whose topics are measured (default test)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    start = time.perf_counter()
    workdir = args.workdir or build_atomic_fixture(args.atomic_fixture)
    measure(workdir, args.split)
    print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
