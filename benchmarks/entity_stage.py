"""index.py's entity stage from the defaults against spaCy's own `nlp.pipe(n_process=<cores>)`, same documents, one run.

    python benchmarks/entity_stage.py [--docs 2000] [--corpus demo_work/corpus]

Prints, with `uptime` and the usable cores (`os.sched_getaffinity`):
- the stage: `cfir_jax.builders.entities.build_entities` with configs/demo.py's defaults (`entity_workers.index` 0:
  one worker per usable core) into a fresh directory, its workers' start included (each loads the pipeline in a fresh
  interpreter while the stage reads the corpus): documents/s;
- spaCy: the same pipeline and labels (`EntityExtractor`'s entities), `nlp.pipe(texts, n_process=<cores>)` with
  its processes started by fork after the model loaded in this process (their start included; the model's load in
  this process is not), and in this process alone: documents/s;
- the stage's rate over spaCy's n_process (issue 60's goal: at least 0.9).
The documents are the corpus's (`--corpus`, all of them), else a synthetic world's of `--docs` documents (250-450
words each, as configs/demo.py's).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

from common import REPO, spacy_pipe_rate  # also puts the repository root on sys.path

from cfir_jax.builders import entities
from cfir_jax.data.corpus import Corpus
from cfir_jax.data.synthetic import SyntheticConfig, generate
from cfir_jax.nlp.entity_workers import Settings
from cfir_jax.stores.entities import entity_key
from cfir_jax.stores.layout import Layout
from configs.demo import get_config


def stage_rate(config, corpus: Corpus) -> tuple[float, list]:
    """Documents/s of the entity stage into a fresh directory, its worker pool's start included; its entities."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        store = entities.build_entities(config, Layout.of(tmp), corpus)
        seconds = time.perf_counter() - t0
        return corpus.num_documents / seconds, [store.entities_of(i) for i in range(store.num_docs)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=2000, help="the synthetic world's documents (without --corpus)")
    p.add_argument("--corpus", default="", help="a corpus directory (default: the demo's synthetic world)")
    args = p.parse_args()
    config = get_config()
    workers = Settings.of(config, "index").workers
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Corpus.open(args.corpus) if args.corpus else \
            generate(Path(tmp) / "corpus", SyntheticConfig(num_documents=args.docs, num_images=200))
        texts = [corpus.document(i).text for i in range(corpus.num_documents)]
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        print(f"commit {commit.stdout.strip()}; {len(texts)} documents; usable cores {len(os.sched_getaffinity(0))}; "
              f"entity_workers.index {config.entity_workers.index} -> {workers} workers")
        print("load before:", os.getloadavg())
        stage, stage_found = stage_rate(config, corpus)
        pooled, pooled_found = spacy_pipe_rate(config.index.entities, texts, workers, "fork")
        alone, _ = spacy_pipe_rate(config.index.entities, texts, 1, "fork")
        print("load after:", os.getloadavg())
    same = [[entity_key(n) for n in d] for d in stage_found] == [[entity_key(n) for n in d] for d in pooled_found]
    print(f"the same entities (the store names an entity by its first surface form): {same}")
    print(f"entity stage (defaults, {workers} workers, start included): {stage:.1f} documents/s")
    print(f"spaCy nlp.pipe(n_process={workers}), forked after load:     {pooled:.1f} documents/s")
    print(f"spaCy nlp.pipe, this process alone:                        {alone:.1f} documents/s")
    print(f"stage / spaCy n_process={workers}: {stage / pooled:.2f}x (goal >= 0.9)")


if __name__ == "__main__":
    main()
