"""The Full fine-tuning input: deterministic, resumable batches of (document row, augmented image pixels).

The stream is a grain pipeline over the corpus' image records (array_record, `Corpus.image_records`):

    MapDataset.range(samples) -> map(_LoadSample) -> batch(local batch) -> to_iter_dataset -> [mp_prefetch(workers)]

Sample k of process p is a pure function of (k, p): step s = k // local batch takes positions
[(s mod steps) * B, +B) of its epoch's order of the pairs (a permutation seeded by (seed, epoch); the remainder of an
epoch that does not fill a global batch B is dropped), and process p takes the contiguous slice
[p * B / P, (p + 1) * B / P) of that global batch. Its augmentation draws from a generator seeded by
(seed, epoch, pair index). So the batches do not depend on the worker count, the union of the processes' slices is
the one-process batch, and a resumed stream is the uninterrupted one.

Decoding and augmentation run in grain worker processes when `workers > 0` (`mp_prefetch`); an image whose bytes are
empty or undecodable becomes a zero image with `valid` False (the loss masks it), counted in `skipped`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import Any

import grain
import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.data.augment import eval_transform, train_transform
from cfir_jax.data.corpus import Corpus
from cfir_jax.data.image_decode import ImageDecodeError, decode_rgb

log = logging.getLogger("cfir_jax.data")

STATE_VERSION = 1
_MAX_EPOCHS = 1_000_000  # the stream's nominal length; a run stops long before
_ORDER, _AUGMENT = 0, 1  # domain tags of the two seeded streams
# What a saved state must agree on to be resumed; the process layout and the worker count may change (the stream
# restarts from the saved step).
_FIXED = ("num_pairs", "pairs_digest", "global_batch", "image_size", "seed", "augment", "shuffled")


def train_pairs(corpus: Corpus, split: str = "train") -> np.ndarray:
    """(document row, image row) [N, 2] int64 of the relevant judgements of `split`, sorted by document id then image
    id (a fixed order the epoch shuffles permute)."""
    qrels = corpus.qrels(split)
    doc_row = {doc_id: i for i, doc_id in enumerate(corpus.doc_ids)}
    image_row = {image_id: i for i, image_id in enumerate(corpus.image_ids)}
    pairs = [(doc_row[d], image_row[i]) for d in sorted(qrels) if d in doc_row
             for i, rel in sorted(qrels[d].items()) if rel > 0 and i in image_row]
    if not pairs:
        raise CfirError(f"{corpus.path}: no relevant (document, image) pairs in the {split!r} qrels")
    return np.asarray(pairs, dtype=np.int64)


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, num_pairs: int, shuffled: bool) -> np.ndarray:
    if not shuffled:
        return np.arange(num_pairs)
    return np.random.default_rng([seed, _ORDER, epoch]).permutation(num_pairs)


class _LoadSample:
    """Sample k of this process's stream -> {pixels uint8 [S, S, 3], doc_rows, image_rows, valid}; picklable, so
    grain's worker processes run it (the image records reopen there)."""

    def __init__(self, records: Any, pairs: np.ndarray, *, global_batch: int, local_batch: int, process_index: int,
                 image_size: int, seed: int, augment: bool, shuffled: bool, randaug: bool = True):
        self.records, self.pairs = records, pairs
        self.global_batch, self.local_batch, self.process_index = global_batch, local_batch, process_index
        self.steps_per_epoch = len(pairs) // global_batch
        self.image_size, self.seed, self.augment, self.shuffled = image_size, seed, augment, shuffled
        self.randaug = randaug

    def locate(self, k: int) -> tuple[int, int]:
        """(epoch, pair index) of sample k: see the module docstring."""
        step, j = divmod(k, self.local_batch)
        epoch, s = divmod(step, self.steps_per_epoch)
        position = s * self.global_batch + self.process_index * self.local_batch + j
        return epoch, int(_epoch_order(self.seed, epoch, len(self.pairs), self.shuffled)[position])

    def __call__(self, k: int) -> dict[str, np.ndarray]:
        epoch, p = self.locate(int(k))
        doc, image = (int(x) for x in self.pairs[p])
        try:
            rgb = decode_rgb(bytes(self.records[image]["image"]))
            if self.augment:
                pixels = train_transform(rgb, self.image_size, np.random.default_rng([self.seed, _AUGMENT, epoch, p]),
                                         randaug=self.randaug)
            else:
                pixels = eval_transform(rgb, self.image_size)
            valid = True
        except ImageDecodeError:
            pixels, valid = np.zeros((self.image_size, self.image_size, 3), np.uint8), False
        return {"pixels": pixels, "doc_rows": np.int32(doc), "image_rows": np.int32(image), "valid": np.bool_(valid)}


def _grain_flags_ready() -> None:
    # grain 0.2.18's mp_prefetch reads one of its absl flags unguarded; the commands parse argparse, not absl, so
    # the flags keep their defaults and are marked parsed here (a later absl parse of argv still works).
    # why: absl's flags load only when grain's worker processes start
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _check(corpus: Corpus, pairs: np.ndarray, global_batch: int, image_size: int, process_index: int,
           process_count: int, workers: int) -> None:
    if pairs.ndim != 2 or pairs.shape[1] != 2 or not np.issubdtype(pairs.dtype, np.integer):
        raise CfirError(f"pairs must be an integer array [N, 2] of (document row, image row), got {pairs.shape} "
                        f"{pairs.dtype}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise CfirError(f"process_index {process_index} is not in [0, process_count={process_count})")
    if global_batch < 1 or global_batch % process_count:
        raise CfirError(f"global batch {global_batch} is not a positive multiple of the process count {process_count}")
    if len(pairs) < global_batch:
        raise CfirError(f"{len(pairs)} training pairs cannot fill one global batch of {global_batch}: lower the batch")
    if image_size < 1 or workers < 0:
        raise CfirError(f"image size {image_size} must be positive and workers {workers} not negative")
    if pairs.min() < 0 or pairs[:, 0].max() >= corpus.num_documents or pairs[:, 1].max() >= corpus.num_images:
        raise CfirError(f"pairs name rows outside {corpus.path} ({corpus.num_documents} documents, "
                        f"{corpus.num_images} images): build them with train_pairs of this corpus")


class PairBatches:
    """Deterministic, resumable batches of (document row, augmented image pixels) for Full training.

    Each `next` is this process's slice of the next global batch: pixels uint8 [B / P, S, S, 3], doc_rows and
    image_rows int32 [B / P], valid bool [B / P] (False where the image was corrupt or missing: zero pixels, masked in
    the loss). `get_state` is a JSON-able position that `set_state` resumes exactly, on any process and any worker
    count; `skipped` counts the invalid images this process met, logged once per epoch.
    """

    def __init__(self, corpus: Corpus, pairs: np.ndarray, *, global_batch: int, image_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1, augment: bool = True, workers: int = 0,
                 epoch_pairs_shuffled: bool = True, randaug: bool = True):
        pairs = np.asarray(pairs)
        _check(corpus, pairs, global_batch, image_size, process_index, process_count, workers)
        self.global_batch, self.local_batch = global_batch, global_batch // process_count
        self.process_index, self.process_count, self.workers = process_index, process_count, workers
        self.steps_per_epoch = len(pairs) // global_batch
        self._fixed = {"num_pairs": len(pairs), "pairs_digest": hashlib.sha1(pairs.astype(np.int64).tobytes())
                       .hexdigest()[:16], "global_batch": global_batch, "image_size": image_size,
                       "seed": int(seed) % 2**63, "shuffled": bool(epoch_pairs_shuffled),
                       # crop and flip without RandAugment is its own value; True (with it) is what older states hold
                       "augment": "crop_flip" if augment and not randaug else bool(augment)}
        # int32 halves what every worker process is sent (AToMiC's 4.4M train pairs: 35 MB); rows fit.
        self._load = _LoadSample(corpus.image_records, pairs.astype(np.int32), global_batch=global_batch,
                                 local_batch=self.local_batch, process_index=process_index, image_size=image_size,
                                 seed=self._fixed["seed"], augment=bool(augment), shuffled=bool(epoch_pairs_shuffled),
                                 randaug=bool(randaug))
        self.step = 0  # global batches taken so far
        self.skipped = 0
        self._epoch_skipped = 0
        self._start(origin=0)

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.step // self.steps_per_epoch

    def _start(self, origin: int, grain_state: dict | None = None) -> None:
        """(Re)builds the grain iterator over the stream from step `origin`, at `grain_state` within it."""
        old = getattr(self, "_iter", None)
        if old is not None and hasattr(old, "close"):
            old.close()
        total = self.steps_per_epoch * _MAX_EPOCHS * self.local_batch
        ds = grain.MapDataset.range(origin * self.local_batch, total).map(self._load)
        ds = ds.batch(self.local_batch, drop_remainder=True)
        # One batch ahead per process: a batch of 512 images at 224 px is 77 MB.
        it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=1))
        if self.workers:
            _grain_flags_ready()
            it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers, per_worker_buffer_size=1))
        self._origin, self._iter = origin, iter(it)
        if grain_state is not None:
            self._iter.set_state(grain_state)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._iter)
        self.step += 1
        missed = int(batch["valid"].size - np.count_nonzero(batch["valid"]))
        self.skipped += missed
        self._epoch_skipped += missed
        if self.step % self.steps_per_epoch == 0:
            if self._epoch_skipped and self.process_index == 0:
                log.warning("epoch %d: %d of %d images skipped on process 0 (corrupt or missing)", self.epoch - 1,
                            self._epoch_skipped, self.steps_per_epoch * self.local_batch)
            self._epoch_skipped = 0
        return batch

    def get_state(self) -> dict:
        """The position after the batches taken so far, JSON-able (ints, strings, bools, lists, dicts)."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "step": self.step, "skipped": self.skipped,
                "epoch_skipped": self._epoch_skipped, "workers": self.workers, "process_count": self.process_count,
                "origin": self._origin, "grain": self._iter.get_state(), **self._fixed}

    def set_state(self, state: dict) -> None:
        """Resumes at `state` (a get_state of a pipeline over the same pairs, batch, size, seed and augmentation)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise CfirError(f"data iterator state of version {state.get('version') if isinstance(state, dict) else '?'}"
                            f", expected {STATE_VERSION}: the checkpoint comes from another version of the pipeline")
        changed = [k for k in _FIXED if state.get(k) != self._fixed[k]]
        if changed:
            k = changed[0]
            raise CfirError(f"data iterator state was saved with {k}={state.get(k)!r}, this run has "
                            f"{self._fixed[k]!r}: resume with the same pairs, batch, image size, seed and augmentation")
        self.step, self.skipped, self._epoch_skipped = int(state["step"]), int(state["skipped"]), \
            int(state["epoch_skipped"])
        # grain's state is a position within the stream from `origin` for this worker count; with another worker
        # count or process layout, the stream restarts at the saved step (the same batches).
        same = state["workers"] == self.workers and state["process_count"] == self.process_count
        if same:
            self._start(int(state["origin"]), state["grain"])
        else:
            self._start(self.step)

    def close(self) -> None:
        """Stops grain's worker processes (also done at garbage collection)."""
        if hasattr(self._iter, "close"):
            self._iter.close()
