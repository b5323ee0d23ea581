"""Image-side text: the store, its refusals, and fused SR equal to numpy on the exact and device paths."""

import hashlib
import json

import numpy as np
import pytest

from cfir_jax.builders.image_text import build_image_text, image_text
from cfir_jax.core.errors import StoreError
from cfir_jax.data import synthetic
from cfir_jax.data.corpus import Document, Image
from cfir_jax.data.corpus_writer import write_corpus
from cfir_jax.search.compact import build_compact
from cfir_jax.search.cpu_sr import SRScorer
from cfir_jax.search.device_sr import DeviceCache
from cfir_jax.search.fused import FusedRows, fused_queries
from cfir_jax.search.topk import exact_top_k
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.image_text import ImageTextCache

D = 8
REF, ALT, ATTR = ("caption_reference_description", "caption_alt_text_description",
                  "caption_attribution_description")


def grid(n: int, seed: int, zero_rows=()) -> np.ndarray:
    """float16 rows of multiples of 1/4: with integer queries and power-of-two weights every fused score is exact in
    float32 whatever the summation order, so paths must agree bit for bit, ties included."""
    rows = (np.random.default_rng(seed).integers(-4, 5, size=(n, D)) / 4).astype(np.float16)
    rows[list(zero_rows)] = 0
    return rows


def reference(img, txt, q, union, w_img, w_txt, k):
    """numpy: w_img * <q, img> + w_txt * <q, txt> over the union, best first, ties to the lower row."""
    union = np.asarray(union, np.int64)
    s = w_img * (img[union].astype(np.float32) @ q) + w_txt * (txt[union].astype(np.float32) @ q)
    order = np.lexsort((union, -s))[:k]
    return s[order], union[order]


class Unmaterialised(FusedRows):
    """FusedRows that fail when anything copies the whole [N, 2D] matrix (np.asarray of the view: at 4M images
    that is 12 GB per call), so scorers must gather rows."""

    def __array__(self, *args, **kwargs):
        raise AssertionError("the whole fused matrix was materialised")


@pytest.mark.parametrize("path", ["exact", "fast", "device"])
def test_fused_score_equals_weighted_sum_on_the_same_union(path, tmp_path):
    n, k, (w_img, w_txt) = 300, 25, (1.0, 0.5)
    no_text = range(0, n, 3)  # every third image has no text: its text row is zero
    img, txt = grid(n, 0), grid(n, 1, no_text)
    rng = np.random.default_rng(2)
    queries = rng.integers(-3, 4, size=(5, D)).astype(np.float32)
    unions = [np.unique(rng.integers(0, n, size=m)).astype(np.int32) for m in (7, 60, 200, 250, 1)]
    rows, fq = FusedRows(img, txt), fused_queries(queries, w_img, w_txt)
    if path == "exact":
        got = [exact_top_k(rows, q, u, k) for q, u in zip(fq, unions)]
    elif path == "fast":  # the compact copy of the [N, 2D] rows shortlists 64 of up to 250, re-ranked exactly
        rows = Unmaterialised(img, txt)
        compact = build_compact(rows, tmp_path / "compact", dims=2 * D, cache_fingerprint="fused")
        got = SRScorer(rows, compact, shortlist=64, k=k).score_batch(fq, unions)
    else:
        got = DeviceCache(rows, k=k, buckets=(64, 256), query_batch=4).score_batch(fq, unions)
    for q, u, (s, r) in zip(queries, unions, got):
        want_s, want_r = reference(img, txt, q, u, w_img, w_txt, k)
        if path != "device":  # argpartition may order tied rows either way: same scores, each row's own score
            np.testing.assert_array_equal(s, want_s)
            all_s, all_r = reference(img, txt, q, u, w_img, w_txt, len(u))
            score_of = dict(zip(all_r.tolist(), all_s.tolist()))
            assert [score_of[row] for row in r.tolist()] == s.tolist()
            assert {row for row, v in score_of.items() if v > s[-1]} <= set(r.tolist())
        else:
            np.testing.assert_array_equal(r, want_r)
            np.testing.assert_array_equal(s, want_s)


def test_images_without_text_are_scored_by_their_pixels_alone():
    img, txt = grid(10, 0), grid(10, 1, zero_rows=[3, 4])
    q = np.arange(-4, 4, dtype=np.float32)
    s, r = exact_top_k(FusedRows(img, txt), fused_queries(q[None], 2.0, 1.0)[0], np.array([3, 4]), 2)
    want = {row: 2.0 * float(img[row].astype(np.float32) @ q) for row in (3, 4)}
    assert {int(a): float(b) for a, b in zip(r, s)} == want


def test_image_only_query_against_fused_rows_is_the_image_score():
    """The device holds only the fused matrix: [q, 0] must give exactly the image-only search."""
    img, txt = grid(50, 0), grid(50, 1)
    q = np.random.default_rng(3).integers(-3, 4, size=(2, D)).astype(np.float32)
    fused = DeviceCache(FusedRows(img, txt), k=10).full_topk(fused_queries(q, 1.0, 0.0), 10)
    plain = DeviceCache(img, k=10).full_topk(q, 10)
    np.testing.assert_array_equal(fused[0], plain[0])
    np.testing.assert_array_equal(fused[1], plain[1])


class FakeEncoder:
    """Stands in for the frozen text tower: a text's embedding is a function of its bytes; counts what it encodes."""

    max_len, dim = 16, D

    def __init__(self, fail_after: int | None = None):
        self.encoded: list[str] = []
        self.fail_after = fail_after

    def encode(self, texts):
        if self.fail_after is not None and len(self.encoded) >= self.fail_after:
            raise KeyboardInterrupt  # an interrupted build
        self.encoded += list(texts)
        out = np.stack([np.frombuffer(hashlib.sha256(t.encode()).digest()[:D], np.uint8) for t in texts])
        out = out.astype(np.float32) - 127.5
        return out / np.linalg.norm(out, axis=1, keepdims=True)


IMAGE_TEXTS = [{REF: ("A photo of Ann Lee.",), ATTR: ("Photo by Bo",)}, {}, {ALT: ("The harbour", "The harbour")},
               {REF: ("  ",)}, {REF: ("Lake Ashford",), ALT: ("Lake Ashford",)}]


@pytest.fixture
def corpus_and_cache(tmp_path):
    """A 5-image corpus (two without text) and a cache that skipped image 1 and holds the rest in another order."""
    images = [Image(f"i{r}", caption="c", texts=t) for r, t in enumerate(IMAGE_TEXTS)]
    corpus = write_corpus(tmp_path / "corpus", "t", [Document("d0", "text")], images, {})
    ids = ["i4", "i0", "i2", "i3"]
    manifest = {"kind": "image_cache", "dim": D, "num_encoded": len(ids), "created": "x"}
    return corpus, ImageCache(tmp_path / "cache", manifest, ids, grid(len(ids), 5))


def test_store_follows_the_cache_rows_and_marks_images_without_text(tmp_path, corpus_and_cache):
    corpus, cache = corpus_and_cache
    assert corpus.manifest["images_with_text"] == 3 and corpus.image(2).texts == {ALT: ("The harbour", "The harbour")}
    enc = FakeEncoder()
    store = build_image_text(tmp_path / "it", corpus, cache, enc, "text-A", chunk_rows=3)
    assert store.has_text.tolist() == [True, True, True, False]  # i3's only text is blank
    texts = ["Lake Ashford", "A photo of Ann Lee. Photo by Bo", "The harbour"]
    assert sorted(enc.encoded) == sorted(texts)  # images without text are never encoded
    np.testing.assert_array_equal(store.embeddings[:3], FakeEncoder().encode(texts).astype(np.float16))
    assert not store.embeddings[3].any()
    assert (store.manifest["num_with_text"], store.manifest["fingerprint"]) == (3, "text-A")


def test_store_built_by_another_encoder_or_for_another_cache_is_refused(tmp_path, corpus_and_cache):
    corpus, cache = corpus_and_cache
    build_image_text(tmp_path / "it", corpus, cache, FakeEncoder(), "text-A")
    ImageTextCache.open(tmp_path / "it", expect_fingerprint="text-A",
                        expect_cache_fingerprint=cache.content_fingerprint)
    with pytest.raises(StoreError, match="stale, built for fingerprint='text-A' but that is now 'text-B'; rebuild it "
                       "with index.py --stages image_text") as e:
        ImageTextCache.open(tmp_path / "it", expect_fingerprint="text-B")
    assert "\n" not in str(e.value)
    with pytest.raises(StoreError, match="stale, built for cache_fingerprint="):
        ImageTextCache.open(tmp_path / "it", expect_cache_fingerprint="cache-other")
    enc = FakeEncoder()  # another encoder: the build is not reused but redone
    build_image_text(tmp_path / "it", corpus, cache, enc, "text-B")
    assert enc.encoded and ImageTextCache.open(tmp_path / "it").manifest["fingerprint"] == "text-B"


def test_interrupted_build_resumes_after_its_finished_chunks(tmp_path, corpus_and_cache):
    corpus, cache = corpus_and_cache
    with pytest.raises(KeyboardInterrupt):
        build_image_text(tmp_path / "it", corpus, cache, FakeEncoder(fail_after=1), "text-A", chunk_rows=2)
    assert not (tmp_path / "it").exists()  # an incomplete store is never published
    enc = FakeEncoder()
    store = build_image_text(tmp_path / "it", corpus, cache, enc, "text-A", chunk_rows=2)
    assert enc.encoded == ["The harbour"]  # rows 0-1 were done before the interruption
    whole = build_image_text(tmp_path / "whole", corpus, cache, FakeEncoder(), "text-A", chunk_rows=4)
    np.testing.assert_array_equal(store.embeddings, whole.embeddings)


def test_image_text_joins_fields_in_order_without_duplicates():
    img = Image("x", texts={ALT: ("b", " a "), REF: ("a",), ATTR: ("",)})
    assert image_text(img) == "a b"
    assert image_text(img, [ALT]) == "b a"


def test_synthetic_image_text_has_its_own_stream_and_is_noisy(monkeypatch):
    world = synthetic.build_world(synthetic.SyntheticConfig.tiny())
    monkeypatch.setattr(synthetic, "IMAGE_TEXT_STREAM", synthetic.IMAGE_TEXT_STREAM + 1)
    other = synthetic.build_world(synthetic.SyntheticConfig.tiny())
    # Another text stream changes the texts and nothing else of the world.
    assert [i.texts for i in world.images] != [i.texts for i in other.images]
    strip = lambda w: ([(i.image_id, i.caption, i.entities, i.image, i.embedding.tobytes()) for i in w.images],  # noqa
                       w.documents, json.dumps(w.qrels, sort_keys=True))
    assert strip(world) == strip(other)
    texts = [image_text(i) for i in world.images]
    assert 0 < texts.count("") < len(texts) / 2  # sometimes missing
    named = [i for i in world.images if i.texts.get(REF)]
    # The reference description names depicted entities, but not always all of them (noise).
    assert any(n in i.texts[REF][0] for i in named for n in i.entities)
    assert any(not all(n in i.texts[REF][0] for n in i.entities) for i in named)
