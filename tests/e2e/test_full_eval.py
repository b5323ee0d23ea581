"""Evaluating D-BEiT-3 Full (issue 22): W/image_cache_full is the images encoded by W/model_full's own vision tower;
a Full model over the frozen tower's cache is refused in one line; --compare has the Full row."""

import math
import shutil

import numpy as np
import pytest
from repo import TINY_CONFIG, run_script

FULL_CONFIG = "configs/demo.py:tiny,full"


@pytest.fixture(scope="module")
def full_workdir(workdir, tmp_path_factory):
    """A copy of the session's tiny workdir with a Full model trained and its image cache re-encoded."""
    w = tmp_path_factory.mktemp("full_eval") / "w"
    shutil.copytree(workdir, w, symlinks=True)
    run_script("train.py", "--config", FULL_CONFIG, "--workdir", str(w))
    run_script("index.py", "--config", TINY_CONFIG, "--workdir", str(w), "--stages", "image_cache_full")
    return w


def test_full_cache_is_the_full_towers_own_encoding_of_the_images(full_workdir):
    from flax import nnx

    from cfir_jax.builders.image_encoding import _decode_row
    from cfir_jax.data.corpus import Corpus
    from cfir_jax.model import checkpoint
    from cfir_jax.stores.image_cache import ImageCache

    model = checkpoint.load_model(full_workdir / "model_full")
    cache = ImageCache.open(full_workdir / "image_cache_full")
    frozen = ImageCache.open(full_workdir / "image_cache")
    assert cache.fingerprint == checkpoint.read_model_manifest(full_workdir / "model_full")["vision_fingerprint"]
    assert cache.fingerprint != frozen.fingerprint
    corpus = Corpus.open(full_workdir / "corpus")
    rows = range(min(8, corpus.num_images))
    decoded = [_decode_row(corpus, r, int(model.config.image_size)) for r in rows]
    pixels = np.stack([p for _, p, _ in decoded])
    direct = np.asarray(nnx.jit(lambda m, x: m.encode_image(x))(model, pixels), np.float32)
    stored = cache.gather([cache.index_of(i) for i, _, _ in decoded]).astype(np.float32)
    np.testing.assert_allclose(stored, direct, rtol=2e-2, atol=2e-2)
    old = frozen.gather([frozen.index_of(i) for i, _, _ in decoded]).astype(np.float32)
    assert not np.allclose(old, direct, atol=2e-2)


def test_a_full_model_over_the_frozen_cache_is_refused_in_one_line(full_workdir, config):
    from cfir_jax.core.errors import CfirError
    from cfir_jax.retrieve.methods import method_of
    from cfir_jax.retrieve.stores import open_stores

    cfg = config.copy_and_resolve_references()
    cfg.retrieval.model = "full"
    cfg.retrieval.image_cache = "image_cache"
    with pytest.raises(CfirError) as e:
        open_stores(cfg, full_workdir, method_of("dense_document", cfg.retrieval))
    msg = str(e.value)
    assert "\n" not in msg and "--stages image_cache_full" in msg and msg.count("vision tower") == 2


def test_compare_has_the_full_row_with_finite_metrics(full_workdir):
    proc = run_script("retrieve.py", "--index", str(full_workdir), "--evaluate", "test", "--compare")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("D-BEiT-3 Full"))
    numbers = [float(t) for t in line[len("D-BEiT-3 Full"):].split()[:3]]
    assert len(numbers) == 3 and all(math.isfinite(x) for x in numbers), line
    assert "Full (both towers" in line
    # Its training time per epoch is the Full run's own (W/train_full/timing.jsonl), not the CFIR model's.
    from cfir_jax.eval.train_time import train_time

    full, cfir = train_time(full_workdir / "train_full"), train_time(full_workdir / "train")
    assert full is not None and full.label() in line, line
    assert cfir is None or cfir.label() == full.label() or cfir.label() not in line, line


def test_a_retrained_full_model_marks_its_image_cache_stale_until_reencoded(full_workdir, tmp_path):
    """train.py re-exports W/model_full (here from another seed): it warns that W/image_cache_full holds the old
    tower's embeddings, index.py's table says STALE with the refreshing command, and running it makes it current."""
    w = tmp_path / "w"
    shutil.copytree(full_workdir, w, symlinks=True)
    shutil.rmtree(w / "train_full")
    out = run_script("train.py", "--config", FULL_CONFIG, "--workdir", str(w), "--config.train.seed=1")
    assert f"{w}/image_cache_full holds the previous Full model's image embeddings" in out.stderr, out.stderr[-2000:]
    report = run_script("index.py", "--config", TINY_CONFIG, "--workdir", str(w), "--stages", "summaries").stdout
    row = next(line for line in report.splitlines() if line.startswith("image_cache_full"))
    assert row.split()[-1] == "STALE", report
    assert (f"stale: image_cache_full (model_full retrained); refresh with: python index.py --config CONFIG "
            f"--workdir {w} --stages image_cache_full") in report, report
    # --compare leaves the Full row out (the other rows still run) and says how to refresh its cache.
    compare = run_script("retrieve.py", "--index", str(w), "--evaluate", "test", "--compare")
    assert not any(line.startswith("D-BEiT-3 Full") for line in compare.stdout.splitlines()), compare.stdout
    assert any(line.startswith("full CFIR") for line in compare.stdout.splitlines()), compare.stdout
    assert (f"note: D-BEiT-3 Full: no row, {w}/image_cache_full is stale (model_full retrained); refresh it with: "
            f"python index.py --config CONFIG --workdir {w} --stages image_cache_full") in compare.stderr
    refreshed = run_script("index.py", "--config", TINY_CONFIG, "--workdir", str(w), "--stages", "image_cache_full")
    assert "STALE" not in refreshed.stdout, refreshed.stdout
    again = run_script("index.py", "--config", TINY_CONFIG, "--workdir", str(w), "--stages", "summaries").stdout
    assert "STALE" not in again and "stale" not in again, again
