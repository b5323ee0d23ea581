"""One shard of the index, and the one typed interface by which a front reaches the shards.

The cluster splits the image cache's N rows into S contiguous ranges (`shard_bounds`). Shard s opens one version of
the workdir's cache (memory-mapped: nothing is copied; only its own rows' pages are read), the image-text store when
SR fuses with it, and the live rows, and answers two questions with the single process's own SR front end
(`cfir_jax.retrieve.sr.SRFrontEnd`):

- `score`: SR of each query's part of its candidate union (the rows of the union in [lo, hi), which the front formed
  exactly as one process forms it): exact, fused or the two-pass fast scorer (which then shortlists on this shard's
  part alone), on the CPU or the devices; each query's top-k;
- `search`: an exact search of its own live rows (`SRFrontEnd.exact_search(..., span=(lo, hi))`): the dense methods,
  CFIR's no-entity fallback, the unseen entities' lists, search by image.

Every answer names the version it was computed at, and a shard answers at exactly the version asked for or not at
all. The front merges the shards' answers into the single process's (`cfir_jax.cluster.scoring.ShardedSR`).

`ShardClient` is how a front asks: `LocalShards` (shards in this process: tests, benchmarks) and `RayShards`
(`cfir_jax.cluster.ray_shards`: replicas of Ray Serve deployments, retried and hedged) implement it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import ml_collections
import numpy as np

from cfir_jax.cluster.reload import VersionGone, version_id
from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.sr import SRFrontEnd, powers_of_two
from cfir_jax.retrieve.stores import cache_path
from cfir_jax.search.live_rows import LiveRows
from cfir_jax.serve.resident import index_fingerprint
from cfir_jax.stores import versions
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.image_text import ImageTextCache
from cfir_jax.stores.layout import Layout

Ranked = tuple[np.ndarray, np.ndarray]  # (scores, rows of the cache), best first
IMAGES_ONLY = (1.0, 0.0)


def shard_bounds(num_rows: int, shards: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of `shards` contiguous ranges of num_rows rows, sizes differing by at most one."""
    if shards < 1:
        raise CfirError(f"serve.shards={shards}: use at least 1")
    if shards > num_rows:
        raise CfirError(f"serve.shards={shards} exceeds the {num_rows} rows of the image cache: use at most that")
    edges = [num_rows * s // shards for s in range(shards + 1)]
    return list(zip(edges[:-1], edges[1:]))


@dataclasses.dataclass(frozen=True)
class Answer:
    """A shard's answer and the version id it was computed at."""

    vid: str
    value: Any


@dataclasses.dataclass
class ShardStores:
    """What a shard reads of one version (what `SRFrontEnd` reads of the opened stores): the cache, its live rows,
    the image-text store when SR fuses with it."""

    layout: Layout
    cache: ImageCache
    live: LiveRows
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def embeddings(self):
        return self.cache.embeddings


def _open(config: ml_collections.ConfigDict, layout: Layout) -> ShardStores:
    cache = ImageCache.open(cache_path(config, layout))
    stores = ShardStores(layout, cache, LiveRows.of(cache))
    fusion = config.retrieval.fusion
    if (float(fusion.w_img), float(fusion.w_txt)) != IMAGES_ONLY and (layout.image_text / "manifest.json").is_file():
        stores.extra["image_text"] = ImageTextCache.open(layout.image_text,
                                                         expect_cache_fingerprint=cache.content_fingerprint)
    return stores


def committed_id(workdir: str | Path) -> str:
    """The id of the workdir's committed version (`cfir_jax.cluster.reload.version_id`), read under the commit's
    shared lock."""
    with versions.reading(workdir) as version:
        return version_id(version, index_fingerprint(workdir))


class ShardSearch:
    """The search of shard `shard` of `shards` at the workdir's committed version: its rows (read-only,
    memory-mapped) scored and searched. vid: the version id asked for; VersionGone when the workdir holds another."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, shard: int, shards: int, vid: str = ""):
        with versions.reading(workdir) as version:
            self.vid = version_id(version, index_fingerprint(workdir))
            if vid and vid != self.vid:
                raise VersionGone(vid, self.vid, f"shard {shard}: ")
            stores = _open(config, Layout.of(workdir))
        self.shard, self.shards = shard, shards
        self.lo, self.hi = shard_bounds(stores.cache.num_images, shards)[shard]
        rcfg = config.retrieval
        fusion = (float(rcfg.fusion.w_img), float(rcfg.fusion.w_txt))
        self.sr = {False: SRFrontEnd(rcfg, stores, fusion, False)}
        if "image_text" in stores.extra:
            self.sr[True] = SRFrontEnd(rcfg, stores, fusion, True)
        for sr in self.sr.values():
            sr.prepare()  # the compact copy or the device copy now, not in a request's time
        self.live, self.top_k = stores.live, int(rcfg.top_k)

    def _sr(self, fused: bool) -> SRFrontEnd:
        if fused not in self.sr:
            raise CfirError(f"shard {self.shard}: no image-text store to fuse with (retrieval.fusion asks for one)")
        return self.sr[fused]

    def score(self, fused: bool, queries: np.ndarray, parts: Sequence[np.ndarray]) -> Answer:
        """SR of each query's part of its union (global rows in [lo, hi), sorted): a Ranked per query."""
        sr, out = self._sr(fused), [_EMPTY] * len(parts)
        full = [i for i, p in enumerate(parts) if len(p)]
        if any(parts[i][0] < self.lo or parts[i][-1] >= self.hi for i in full):
            raise CfirError(f"shard {self.shard} holds rows [{self.lo}, {self.hi}) of version {self.vid}: asked for "
                            "rows outside them (the front cut the union for another number of rows)")
        if full:
            scored = sr.score_unions(np.asarray(queries, np.float32)[full], [parts[i] for i in full])
            for i, ranked in zip(full, scored):
                out[i] = (np.asarray(ranked[0], np.float32), np.asarray(ranked[1], np.int32))
        return Answer(self.vid, out)

    def search(self, queries: np.ndarray, k: int, weights: tuple[float, float] = IMAGES_ONLY) -> Answer:
        """Exact top-k over this shard's live rows, queries [Q, D] -> (scores, rows) [Q, k'], weights (w_img, w_txt)
        of a fused search (the default scores the images alone)."""
        sr = self._sr(tuple(weights) != IMAGES_ONLY)
        found = sr.exact_search(np.asarray(queries, np.float32), k, self.live, tuple(weights), span=(self.lo, self.hi))
        return Answer(self.vid, found)

    def warm_up(self, max_batch: int) -> None:
        """Compiles what a front's batch of up to max_batch documents sends, before this version answers: the
        device SR's buckets at each query batch and the exact search of its rows at each batch size."""
        for fused, sr in self.sr.items():
            sr.warm_up(max_batch)
            weights = sr.fusion if fused else IMAGES_ONLY
            for q in powers_of_two(max_batch):
                self.search(np.zeros((q, sr.embeddings.shape[1]), np.float32), self.top_k, weights)

    def describe(self) -> dict:
        return {"shard": self.shard, "rows": [self.lo, self.hi], "live_rows": self.live.num_live, "version": self.vid}


_EMPTY: Ranked = (np.zeros(0, np.float32), np.zeros(0, np.int32))


@runtime_checkable
class ShardClient(Protocol):
    """How a front asks the shards, every call at one version id; each returns per shard what `ShardSearch` answers,
    checked to be of that version (CfirError otherwise)."""

    shards: int  # how many; shard s holds rows shard_bounds(N, shards)[s] of a version of N rows

    def score(self, vid: str, fused: bool, queries: np.ndarray, parts: dict[int, list[np.ndarray]]
              ) -> dict[int, list[Ranked]]:
        """SR of the parts: for each shard asked (parts[s]: each query's rows in its range), a Ranked per query."""

    def search(self, vid: str, queries: np.ndarray, k: int, weights: tuple[float, float]) -> list[Ranked]:
        """Every shard's exact top-k of its live rows: per shard (scores, rows) [Q, k']."""


def checked(s: int, vid: str, answer: Answer):
    """The value of shard s's answer, CfirError when it was computed at another version than `vid`."""
    if answer.vid != vid:
        raise CfirError(f"shard {s} answered at version {answer.vid}, not {vid}")
    return answer.value


class LocalShards:
    """The shards as objects of this process (`ShardSearch`es of one version): the tests' and benchmarks'."""

    def __init__(self, shards: Sequence[ShardSearch]):
        self.parts = list(shards)
        self.shards = len(self.parts)

    def score(self, vid, fused, queries, parts):
        return {s: checked(s, vid, self.parts[s].score(fused, queries, p)) for s, p in parts.items()}

    def search(self, vid, queries, k, weights):
        return [checked(s, vid, shard.search(queries, k, weights)) for s, shard in enumerate(self.parts)]
