"""Image decoding and the image embedding cache: rows equal the model, skips, resume, refusal, import, 8 devices."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from atomic_fixtures import CORRUPT, webp_bytes
from flax import nnx
from PIL import Image as PILImage
from repo import ROOT

from cfir_jax.builders.image_encoding import EncodeSettings, Precomputed, build_image_cache
from cfir_jax.core.config import model_config
from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.data.corpus import Corpus, Document, Image
from cfir_jax.data.corpus_writer import write_corpus
from cfir_jax.model.beit3 import abstract_model, param_path
from cfir_jax.model.checkpoint import fingerprint
from cfir_jax.model.preprocess import ImageDecodeError, decode_image
from cfir_jax.stores.image_cache import ImageCache

SIZE = 32
BATCH, SHARD = 4, 8
F16 = dict(rtol=2e-3, atol=2e-3)  # float16 storage of unit-norm rows


def tiny_config():
    return model_config("tiny", image_size=SIZE, vocab_size=300, max_text_positions=40)


def random_model(seed: int = 0):
    """A tiny DBeit3 with seeded numpy weights: ~10x faster than `create_model`'s op-by-op eager initialisation,
    which dominates this file's run time otherwise (LayerNorm scales near 1, everything else N(0, 0.05))."""
    graphdef, state = nnx.split(abstract_model(tiny_config()))
    rng = np.random.default_rng(seed)

    def init(path, leaf):
        base = 1.0 if "scale" in param_path(path) else 0.0
        return jnp.asarray(base + rng.normal(0, 0.05, leaf.shape), leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(init, state))


def encoded(array: np.ndarray, fmt: str, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    PILImage.fromarray(array).convert(mode).save(buf, format=fmt)
    return buf.getvalue()


def corpus_images() -> list[Image]:
    """21 images: noise of varied sizes and modes (RGB/RGBA/L/P; PNG/JPEG/WebP), one corrupt, one empty,
    one truncated; the bad ones sit in different shards."""
    rng = np.random.default_rng(0)
    images = []
    for k in range(18):
        noise = rng.integers(0, 256, (16 + 3 * k, 40 - k, 3), dtype=np.uint8)
        fmt, mode = [("PNG", "RGB"), ("PNG", "RGBA"), ("JPEG", "L"), ("PNG", "P"), ("WEBP", "RGB")][k % 5]
        images.append(Image(f"img{k}", image=encoded(noise, fmt, mode)))
    images.insert(3, Image("corrupt", image=CORRUPT))
    images.insert(10, Image("empty", image=b""))
    truncated = encoded(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), "PNG")[:200]
    images.insert(17, Image("truncated", image=truncated))
    return images


BAD = {"corrupt", "empty", "truncated"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    root = tmp_path_factory.mktemp("corpus")
    return write_corpus(root / "c", "cache-test", [Document("d0", "a document")], corpus_images(), {})


@pytest.fixture(scope="module")
def model():
    return random_model(0)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, corpus, model) -> ImageCache:
    out = tmp_path_factory.mktemp("cache") / "images"
    return build_image_cache(out, corpus, model, encoding=EncodeSettings(batch_size=BATCH, shard_size=SHARD))


# ---------------------------------------------------------------------------------------------------- decoding


def test_decode_maps_pixel_values_to_minus_one_one():
    px = decode_image(encoded(np.full((8, 8, 3), (255, 0, 51), np.uint8), "PNG"), 16)
    assert px.shape == (16, 16, 3) and px.dtype == np.float32
    np.testing.assert_allclose(px[..., 0], 1.0)
    np.testing.assert_allclose(px[..., 1], -1.0)
    np.testing.assert_allclose(px[..., 2], 51 / 127.5 - 1, atol=1e-6)


def test_decode_stretches_without_cropping():
    # A wide image, left half red, right half blue: a centre crop would lose the red; a stretch keeps both halves.
    arr = np.zeros((10, 80, 3), np.uint8)
    arr[:, :40, 0] = 255
    arr[:, 40:, 2] = 255
    px = decode_image(encoded(arr, "PNG"), 16)
    assert px.shape == (16, 16, 3)
    np.testing.assert_allclose(px[:, :6, 0], 1.0, atol=1e-6)
    np.testing.assert_allclose(px[:, -6:, 2], 1.0, atol=1e-6)


def test_decode_resizes_with_pil_bicubic():
    arr = np.random.default_rng(1).integers(0, 256, (21, 13, 3), dtype=np.uint8)
    bicubic = np.asarray(PILImage.fromarray(arr).resize((SIZE, SIZE), PILImage.BICUBIC), np.float32)
    bilinear = np.asarray(PILImage.fromarray(arr).resize((SIZE, SIZE), PILImage.BILINEAR), np.float32)
    px = decode_image(encoded(arr, "PNG"), SIZE)
    np.testing.assert_allclose(px, bicubic / 127.5 - 1, atol=1e-6)
    assert np.abs(px - (bilinear / 127.5 - 1)).max() > 0.05


def test_decode_converts_grayscale_and_alpha_to_rgb():
    arr = np.random.default_rng(2).integers(0, 256, (9, 9, 3), dtype=np.uint8)
    gray = decode_image(encoded(arr, "PNG", "L"), 8)
    rgba = decode_image(encoded(arr, "PNG", "RGBA"), 8)
    assert gray.shape == rgba.shape == (8, 8, 3)
    np.testing.assert_array_equal(gray[..., 0], gray[..., 2])
    np.testing.assert_allclose(rgba, decode_image(encoded(arr, "PNG"), 8))


@pytest.mark.parametrize("data", [b"", CORRUPT, b"\x89PNG\r\n\x1a\n" + b"\x00" * 40], ids=["empty", "webp", "png"])
def test_decode_raises_image_decode_error_for_bad_bytes(data):
    with pytest.raises(ImageDecodeError) as e:
        decode_image(data, SIZE)
    assert "\n" not in str(e.value)


def test_decode_reads_webp():
    px = decode_image(webp_bytes((0, 255, 0)), 4)
    assert px[..., 1].min() > 0.9 and px[..., 0].max() < -0.9


# ---------------------------------------------------------------------------------------------------- building


def test_cache_rows_equal_encode_image_of_decoded_images(cache, corpus, model):
    good = [img for img in corpus_images() if img.image_id not in BAD]
    assert cache.ids == [img.image_id for img in good]
    encode = nnx.jit(lambda m, x: m.encode_image(x))
    want = np.asarray(encode(model, jnp.stack([decode_image(img.image, SIZE) for img in good])))
    assert cache.embeddings.dtype == np.float16 and cache.embeddings.shape == (len(good), 64)
    np.testing.assert_allclose(np.asarray(cache.embeddings, np.float32), want, **F16)


def test_corrupt_and_empty_images_are_skipped_and_listed(cache):
    skipped = {s.image_id: s.reason for s in cache.skipped()}
    assert set(skipped) == BAD
    assert skipped["empty"] == "empty image bytes"
    assert all(r and "\t" not in r for r in skipped.values())
    assert cache.manifest["num_skipped"] == 3 and cache.manifest["num_encoded"] == cache.num_images
    assert not BAD & set(cache.ids)


def test_a_folder_name_in_another_unicode_form_is_named_in_skipped_tsv(tmp_path, model):
    """Zürich.png in NFD and NFC in one folder (cfir_jax.data.files): one image cached under the NFC id, the other
    named in skipped.tsv; ids.txt and skipped.tsv are UTF-8."""
    from cfir_jax.data.files import build_files_corpus

    nfc, nfd = "Z\u00fcrich", "Zu\u0308rich"
    pixels = np.random.default_rng(1).integers(0, 256, (24, 24, 3), dtype=np.uint8)
    (tmp_path / "imgs").mkdir()
    for name in (nfd, nfc, "tom"):
        (tmp_path / "imgs" / f"{name}.png").write_bytes(encoded(pixels, "PNG"))
    (tmp_path / "imgs" / "tom.JPG").write_bytes(encoded(pixels, "JPEG"))
    (tmp_path / "docs.jsonl").write_text(json.dumps({"id": "d0", "text": "Zürich"}) + "\n")
    corpus = build_files_corpus(tmp_path / "docs.jsonl", tmp_path / "imgs", None, tmp_path / "c")
    cache = build_image_cache(tmp_path / "cache", corpus, model, encoding=EncodeSettings(batch_size=BATCH,
                              shard_size=SHARD))
    assert cache.ids == [nfc, "tom", "tom.png"]
    assert [(s.image_id, s.reason) for s in cache.skipped()] == [("Z%C3%BCrich.png", "empty image bytes")]
    assert (tmp_path / "cache" / "ids.txt").read_bytes().decode("utf-8").split("\n")[0] == nfc


def test_manifest_records_fingerprint_dim_dtype_and_sizes(cache, model):
    m = cache.manifest
    assert cache.fingerprint == fingerprint(model, "vision")
    got = (m["dim"], m["dtype"], m["image_size"], m["shard_size"], m["corpus_images"])
    assert got == (64, "float16", SIZE, SHARD, 21)


def test_index_of_and_gather_return_the_rows_of_ids(cache):
    row = cache.index_of("img5")
    assert cache.ids[row] == "img5"
    got = cache.gather([row, 0])
    assert got.dtype == np.float32 and got.shape == (2, 64)
    np.testing.assert_array_equal(got[0], cache.embeddings[row].astype(np.float32))
    with pytest.raises(CfirError, match="'corrupt' is not in the cache"):
        cache.index_of("corrupt")


def test_iter_blocks_covers_every_row_once(cache):
    blocks = list(cache.iter_blocks(5))
    assert [start for start, _ in blocks] == list(range(0, cache.num_images, 5))
    np.testing.assert_array_equal(np.concatenate([b for _, b in blocks]), cache.embeddings.astype(np.float32))


def test_float32_storage_keeps_full_precision(tmp_path, corpus, model, cache):
    c32 = build_image_cache(tmp_path / "c32", corpus, model, encoding=EncodeSettings(batch_size=BATCH,
                            shard_size=SHARD), dtype="float32")
    assert c32.embeddings.dtype == np.float32
    np.testing.assert_allclose(c32.embeddings, cache.embeddings.astype(np.float32), **F16)
    np.testing.assert_allclose(np.linalg.norm(c32.embeddings, axis=1), 1.0, atol=1e-5)


def test_bfloat16_compute_stays_close_to_float32(tmp_path, corpus, model, cache):
    bf = build_image_cache(tmp_path / "bf", corpus, model, encoding=EncodeSettings(batch_size=BATCH, shard_size=SHARD,
                           compute_dtype="bfloat16"))
    assert bf.manifest["compute_dtype"] == "bfloat16"
    cos = np.sum(bf.gather(range(bf.num_images)) * cache.gather(range(cache.num_images)), axis=1)
    assert cos.min() > 0.98
    assert not np.array_equal(bf.embeddings, cache.embeddings)


def test_resume_after_interruption_equals_uninterrupted_build(tmp_path, corpus, model, cache):
    out = tmp_path / "images"

    def crash_after_first(shard):
        raise KeyboardInterrupt(f"simulated crash after shard {shard}")

    with pytest.raises(KeyboardInterrupt):
        build_image_cache(out, corpus, model, encoding=EncodeSettings(batch_size=BATCH, shard_size=SHARD),
                          on_shard=crash_after_first)
    assert not out.exists()
    assert (tmp_path / ".images.building" / "shard-00000.json").is_file()
    done = []
    resumed = build_image_cache(out, corpus, model, encoding=EncodeSettings(batch_size=BATCH, shard_size=SHARD),
                                on_shard=done.append)
    assert done == [1, 2]  # shard 0 came from the interrupted run
    assert resumed.ids == cache.ids
    np.testing.assert_array_equal(resumed.embeddings, cache.embeddings)
    assert [s.image_id for s in resumed.skipped()] == [s.image_id for s in cache.skipped()]
    assert not (tmp_path / ".images.building").exists()


def test_resume_with_another_dtype_starts_over(tmp_path, corpus, model):
    out = tmp_path / "images"

    def crash(shard):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_image_cache(out, corpus, model, encoding=EncodeSettings(batch_size=BATCH, shard_size=SHARD),
                          on_shard=crash)
    done = []
    c = build_image_cache(out, corpus, model, encoding=EncodeSettings(batch_size=BATCH, shard_size=SHARD),
                          dtype="float32", on_shard=done.append)
    assert done == [0, 1, 2] and c.dtype == np.float32


def test_complete_current_cache_is_not_rebuilt(cache, corpus, model):
    before = (cache.path / "manifest.json").read_text()
    calls = []
    again = build_image_cache(cache.path, corpus, model, encoding=EncodeSettings(batch_size=BATCH, shard_size=SHARD),
                              on_shard=calls.append)
    assert calls == [] and (cache.path / "manifest.json").read_text() == before
    assert again.ids == cache.ids


def test_bad_dtype_and_missing_model_are_refused(tmp_path, corpus, model):
    with pytest.raises(CfirError, match="dtype='int8'"):
        build_image_cache(tmp_path / "x", corpus, model, dtype="int8")
    with pytest.raises(CfirError, match="no model and no precomputed"):
        build_image_cache(tmp_path / "x", corpus)


# ---------------------------------------------------------------------------------------------------- opening


def one_line_store_error(**kwargs) -> str:
    with pytest.raises(StoreError) as e:
        ImageCache.open(**kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_open_refuses_cache_of_another_model(cache):
    other = random_model(1)
    msg = one_line_store_error(path=cache.path, expect_fingerprint=fingerprint(other, "vision"))
    assert "fingerprint" in msg and cache.fingerprint in msg


def test_open_refuses_cache_of_another_dim(cache):
    assert "dim=64" in one_line_store_error(path=cache.path, expect_dim=768)


def test_open_accepts_matching_expectations(cache):
    assert ImageCache.open(cache.path, expect_fingerprint=cache.fingerprint, expect_dim=64).num_images == 18


def test_open_refuses_missing_and_incomplete_stores(tmp_path, cache):
    assert "missing directory" in one_line_store_error(path=tmp_path / "nothing")
    (tmp_path / "half").mkdir()
    assert "incomplete" in one_line_store_error(path=tmp_path / "half")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text((cache.path / "manifest.json").read_text())
    (broken / "ids.txt").write_text((cache.path / "ids.txt").read_text())
    np.save(broken / "embeddings.npy", np.zeros((3, 64), np.float16))
    assert "disagree with the manifest" in one_line_store_error(path=broken)


# ---------------------------------------------------------------------------------------------------- import


@pytest.fixture(scope="module")
def emb_corpus(tmp_path_factory) -> Corpus:
    rng = np.random.default_rng(3)
    images = [Image(f"e{k}", embedding=rng.standard_normal(16).astype(np.float32)) for k in range(10)]
    return write_corpus(tmp_path_factory.mktemp("emb") / "c", "emb", [Document("d", "x")], images, {})


def test_import_corpus_embeddings(tmp_path, emb_corpus):
    c = build_image_cache(tmp_path / "c", emb_corpus, precomputed=Precomputed("corpus"), dtype="float32")
    assert c.ids == emb_corpus.image_ids and c.fingerprint.startswith("precomputed:")
    np.testing.assert_array_equal(c.embeddings, emb_corpus.embeddings())


def test_import_npy_matches_rows_to_corpus_ids(tmp_path, emb_corpus):
    emb = np.asarray(emb_corpus.embeddings())
    order = np.random.default_rng(4).permutation(10)
    np.save(tmp_path / "vecs.npy", emb[order])
    (tmp_path / "vecs.ids.txt").write_text("".join(f"{emb_corpus.image_ids[r]}\n" for r in order))
    c = build_image_cache(tmp_path / "c", emb_corpus, precomputed=Precomputed(tmp_path / "vecs.npy"))
    assert c.ids == emb_corpus.image_ids
    np.testing.assert_allclose(c.gather(range(10)), emb, rtol=1e-3)


def test_import_npy_without_ids_file_is_refused(tmp_path, emb_corpus):
    np.save(tmp_path / "vecs.npy", np.zeros((10, 16), np.float32))
    with pytest.raises(CfirError, match="vecs.ids.txt"):
        build_image_cache(tmp_path / "c", emb_corpus, precomputed=Precomputed(tmp_path / "vecs.npy"))


def write_parquet(path: Path, ids: list[str], emb: np.ndarray) -> Path:
    pq.write_table(pa.table({"image_id": ids, "embedding": [list(map(float, r)) for r in emb]}), path)
    return path


def test_import_parquet_matches_rows_to_corpus_ids(tmp_path, emb_corpus):
    emb = np.asarray(emb_corpus.embeddings())
    ids = emb_corpus.image_ids
    src = write_parquet(tmp_path / "e.parquet", ids[::-1], emb[::-1])
    c = build_image_cache(tmp_path / "c", emb_corpus, precomputed=Precomputed(src), dtype="float32")
    np.testing.assert_array_equal(c.embeddings, emb)
    assert c.manifest["num_skipped"] == 0


def test_import_names_unknown_ids(tmp_path, emb_corpus):
    ids = emb_corpus.image_ids[:9] + ["stranger"]
    src = write_parquet(tmp_path / "e.parquet", ids, np.ones((10, 16)))
    with pytest.raises(CfirError, match="1 image ids are not in corpus .*'stranger'"):
        build_image_cache(tmp_path / "c", emb_corpus, precomputed=Precomputed(src))
    assert not (tmp_path / "c").exists()


def test_import_names_missing_ids_unless_allowed(tmp_path, emb_corpus):
    emb = np.asarray(emb_corpus.embeddings())
    src = write_parquet(tmp_path / "e.parquet", emb_corpus.image_ids[2:], emb[2:])
    with pytest.raises(CfirError, match="2 corpus images have no embedding .*'e0', 'e1'"):
        build_image_cache(tmp_path / "c", emb_corpus, precomputed=Precomputed(src))
    c = build_image_cache(tmp_path / "c", emb_corpus, precomputed=Precomputed(src, allow_missing=True), dtype="float32")
    assert c.ids == emb_corpus.image_ids[2:]
    assert [s.image_id for s in c.skipped()] == ["e0", "e1"]
    np.testing.assert_array_equal(c.embeddings, emb[2:])


def test_import_refuses_duplicate_ids_and_wrong_columns(tmp_path, emb_corpus):
    ids = emb_corpus.image_ids + ["e3"]
    src = write_parquet(tmp_path / "dup.parquet", ids, np.ones((11, 16)))
    with pytest.raises(CfirError, match="'e3' has more than one embedding row"):
        build_image_cache(tmp_path / "c", emb_corpus, precomputed=Precomputed(src))
    pq.write_table(pa.table({"id": ["e0"], "vec": [[1.0]]}), tmp_path / "cols.parquet")
    with pytest.raises(CfirError, match="needs columns 'image_id' and 'embedding'"):
        build_image_cache(tmp_path / "c", emb_corpus, precomputed=Precomputed(tmp_path / "cols.parquet"))


def test_import_of_corpus_without_embeddings_is_refused(tmp_path, corpus):
    with pytest.raises(CfirError, match="no precomputed embeddings"):
        build_image_cache(tmp_path / "c", corpus, precomputed=Precomputed("corpus"))


# ---------------------------------------------------------------------------------------------------- devices


def test_eight_devices_equal_one_device(tmp_path, corpus, cache):
    script = textwrap.dedent(
        f"""
        import jax, json, sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests" / "unit" / "stores")!r}, {str(ROOT / "tests" / "helpers")!r}]
        from cfir_jax.data.corpus import Corpus
        from cfir_jax.builders.image_encoding import EncodeSettings, build_image_cache
        from test_image_cache import random_model
        model = random_model(0)
        c = build_image_cache({str(tmp_path / "c8")!r}, Corpus.open({str(corpus.path)!r}), model,
                              encoding=EncodeSettings(batch_size=5, shard_size={SHARD}))
        print(json.dumps({{"devices": jax.local_device_count(), "batch": c.manifest["batch_size"]}}))
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info == {"devices": 8, "batch": 8}  # 5 rounded up to a multiple of the 8 devices
    multi = ImageCache.open(tmp_path / "c8", expect_fingerprint=cache.fingerprint)
    assert multi.ids == cache.ids
    np.testing.assert_allclose(multi.gather(range(multi.num_images)), cache.gather(range(cache.num_images)),
                               rtol=0, atol=1e-3)
