"""The Full fine-tuning image pipeline: process slices, exact resume, worker count, skipped images, augmentation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image as PILImage
from PIL import ImageOps

from cfir_jax.core.errors import CfirError
from cfir_jax.data import augment
from cfir_jax.data.image_pipeline import PairBatches
from cfir_jax.model.preprocess import decode_image

SIZE = 32
BATCH = 8  # the tiny world has 42 train pairs: 5 steps an epoch
KEYS = ("pixels", "doc_rows", "image_rows", "valid")


def _take(batches: PairBatches, n: int) -> list[dict]:
    return [next(batches) for _ in range(n)]


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        for key in KEYS:
            np.testing.assert_array_equal(x[key], y[key], err_msg=f"step {step} {key}")


def test_train_pairs_are_the_relevant_judgements_in_id_order(world_corpus):
    corpus, pairs, _ = world_corpus
    qrels = corpus.qrels("train")
    expected = [(corpus.doc_ids.index(d), corpus.image_ids.index(i))
                for d in sorted(qrels) for i in sorted(qrels[d]) if qrels[d][i] > 0]
    assert pairs.tolist() == [list(p) for p in expected]
    assert pairs.shape == (42, 2)


def test_two_processes_slices_make_the_one_process_batch(world_corpus):
    corpus, pairs, _ = world_corpus
    kw = dict(global_batch=BATCH, image_size=SIZE, seed=3)
    one = _take(PairBatches(corpus, pairs, **kw), 7)  # past the first epoch's end (step 5)
    halves = [_take(PairBatches(corpus, pairs, process_index=p, process_count=2, **kw), 7) for p in (0, 1)]
    for step, (whole, a, b) in enumerate(zip(one, *halves)):
        assert a["pixels"].shape == (BATCH // 2, SIZE, SIZE, 3) and a["pixels"].dtype == np.uint8
        for key in KEYS:
            np.testing.assert_array_equal(np.concatenate([a[key], b[key]]), whole[key], err_msg=f"{step} {key}")
    # Process 0's saved position resumes process 1 as well (the state names a step, not a process's data).
    first = PairBatches(corpus, pairs, process_index=0, process_count=2, **kw)
    _take(first, 3)
    second = PairBatches(corpus, pairs, process_index=1, process_count=2, **kw)
    second.set_state(json.loads(json.dumps(first.get_state())))
    _assert_same(_take(second, 4), halves[1][3:])
    # Each epoch is a permutation: its 5 batches take 40 distinct pairs of the 42.
    epoch0 = [(d, i) for b in one[:5] for d, i in zip(b["doc_rows"], b["image_rows"])]
    assert len(set(epoch0)) == 40 and set(epoch0) <= set(map(tuple, pairs.tolist()))


def test_resume_after_three_batches_equals_the_uninterrupted_run(world_corpus, tmp_path):
    import orbax.checkpoint as ocp

    corpus, pairs, _ = world_corpus
    kw = dict(global_batch=BATCH, image_size=SIZE, seed=5)
    uninterrupted = _take(PairBatches(corpus, pairs, **kw), 12)
    first = PairBatches(corpus, pairs, **kw)
    _take(first, 3)
    # Saved and restored as the trainer keeps its data position: orbax's JSON item beside the state.
    with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",)) as manager:
        manager.save(3, args=ocp.args.Composite(data=ocp.args.JsonSave(first.get_state())))
        manager.wait_until_finished()
        state = manager.restore(3, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    assert (state["epoch"], state["step"]) == (0, 3)
    resumed = PairBatches(corpus, pairs, **kw)
    resumed.set_state(state)
    _assert_same(_take(resumed, 9), uninterrupted[3:])  # batches 4..12: two epoch boundaries
    assert resumed.skipped == sum(int((~b["valid"]).sum()) for b in uninterrupted)
    with pytest.raises(CfirError, match="seed"):
        PairBatches(corpus, pairs, **{**kw, "seed": 6}).set_state(state)


def test_worker_processes_give_the_same_batches_and_resume(world_corpus):
    corpus, pairs, _ = world_corpus
    kw = dict(global_batch=BATCH, image_size=SIZE, seed=7)
    inline = _take(PairBatches(corpus, pairs, **kw), 8)
    workers = PairBatches(corpus, pairs, workers=2, **kw)
    _assert_same(_take(workers, 3), inline[:3])
    state = json.loads(json.dumps(workers.get_state()))
    workers.close()
    again = PairBatches(corpus, pairs, workers=2, **kw)  # grain's own iterator state, two workers
    again.set_state(state)
    _assert_same(_take(again, 5), inline[3:])
    again.close()
    inline_resumed = PairBatches(corpus, pairs, **kw)  # the same position without workers
    inline_resumed.set_state(state)
    _assert_same(_take(inline_resumed, 5), inline[3:])


def test_corrupt_and_missing_images_are_skipped_and_counted(world_corpus, caplog):
    corpus, pairs, broken = world_corpus
    batches = PairBatches(corpus, pairs, global_batch=BATCH, image_size=SIZE, seed=0, epoch_pairs_shuffled=False)
    with caplog.at_level("WARNING", logger="cfir_jax.data"):
        epoch = _take(batches, 5)  # in file order the broken images are the first two pairs
    assert [r.getMessage() for r in caplog.records] == ["epoch 0: 2 of 40 images skipped on process 0 (corrupt or "
                                                        "missing)"]
    for b in epoch:
        assert b["pixels"].shape == (BATCH, SIZE, SIZE, 3)
        invalid = ~b["valid"]
        assert set(b["image_rows"][invalid].tolist()) <= broken
        assert not b["pixels"][invalid].any() and all(b["pixels"][i].any() for i in np.flatnonzero(b["valid"]))
    assert not epoch[0]["valid"][:2].any() and epoch[0]["valid"][2:].all()
    assert batches.skipped == 2 and batches.get_state()["skipped"] == 2


def test_augmentation_changes_pixels_and_eval_mode_is_the_eval_decode(world_corpus):
    corpus, pairs, _ = world_corpus
    kw = dict(global_batch=BATCH, image_size=SIZE, seed=0, epoch_pairs_shuffled=False)
    plain = _take(PairBatches(corpus, pairs, augment=False, **kw), 5)
    augmented = _take(PairBatches(corpus, pairs, augment=True, **kw), 10)
    for b in plain:
        for row, pixels, valid in zip(b["image_rows"], b["pixels"], b["valid"]):
            if valid:
                normalised = (pixels.astype(np.float32) / 255.0 - 0.5) / 0.5
                np.testing.assert_array_equal(normalised, decode_image(corpus.image(int(row)).image, SIZE))
    valid = np.concatenate([b["valid"] for b in plain])
    changed = [(p != a).any() for bp, ba in zip(plain, augmented[:5]) for p, a in zip(bp["pixels"], ba["pixels"])]
    assert all(np.asarray(changed)[valid])
    # Epoch 1 augments the same pairs (same order here) with other draws.
    redraw = [(a != b).any() for e0, e1 in zip(augmented[:5], augmented[5:])
              for a, b in zip(e0["pixels"], e1["pixels"])]
    assert np.mean(np.asarray(redraw)[valid]) > 0.9


def test_randaug_off_is_the_crop_and_flip_alone_and_a_state_of_either_refuses_the_other(world_corpus):
    """train.randaug=False (the authors' command: no --randaug): the same crop and flip as with RandAugment, the
    ops left out; a saved data state records which, so a run never resumes under the other."""
    corpus, pairs, _ = world_corpus
    rgb = PILImage.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), np.uint8))
    for seed in range(8):
        with_ops = augment.train_transform(rgb, SIZE, np.random.default_rng(seed))
        rng = np.random.default_rng(seed)
        without = augment.train_transform(rgb, SIZE, rng, randaug=False)
        replay = np.random.default_rng(seed)
        top, left, h, w = augment.crop_box(rgb.width, rgb.height, replay)
        img = rgb.crop((left, top, left + w, top + h)).resize((SIZE, SIZE), PILImage.BICUBIC)
        if replay.random() < 0.5:
            img = img.transpose(PILImage.Transpose.FLIP_LEFT_RIGHT)
        np.testing.assert_array_equal(without, np.asarray(img))
        assert with_ops.shape == without.shape
    kw = dict(global_batch=BATCH, image_size=SIZE, seed=0)
    state = PairBatches(corpus, pairs, randaug=False, **kw).get_state()
    assert state["augment"] == "crop_flip" and PairBatches(corpus, pairs, **kw).get_state()["augment"] is True
    with pytest.raises(CfirError, match="augment"):
        PairBatches(corpus, pairs, **kw).set_state(state)


def test_lookup_table_ops_equal_pil_imageops():
    """randaug.py's autocontrast and equalize are PIL's ImageOps ones (its docstrings say so): ours must be too."""
    rng = np.random.default_rng(0)
    pixels = (rng.beta(2, 5, (40, 30, 3)) * 200 + 20).astype(np.uint8)
    pil = PILImage.fromarray(pixels)
    for name, reference in (("AutoContrast", ImageOps.autocontrast), ("Equalize", ImageOps.equalize)):
        np.testing.assert_array_equal(augment._apply(name, pixels, 0.7, rng), np.asarray(reference(pil)), err_msg=name)


def test_crop_box_stays_inside_and_covers_half_the_area_or_more():
    rng = np.random.default_rng(1)
    for width, height in [(96, 96), (300, 40), (40, 300), (7, 5)]:
        for _ in range(50):
            top, left, h, w = augment.crop_box(width, height, rng)
            assert 0 <= top and top + h <= height and 0 <= left and left + w <= width and h > 0 and w > 0
            if width == height == 96:
                assert 0.5 * 96 * 96 * 0.95 <= h * w <= 96 * 96


def test_bad_arguments_are_one_line_errors(world_corpus):
    corpus, pairs, _ = world_corpus
    with pytest.raises(CfirError, match="cannot fill one global batch"):
        PairBatches(corpus, pairs, global_batch=64, image_size=SIZE, seed=0)
    with pytest.raises(CfirError, match="multiple of the process count"):
        PairBatches(corpus, pairs, global_batch=9, image_size=SIZE, seed=0, process_count=2)
    with pytest.raises(CfirError, match="rows outside"):
        PairBatches(corpus, pairs + [0, 1000], global_batch=BATCH, image_size=SIZE, seed=0)
