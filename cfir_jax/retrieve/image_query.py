"""Search by picture: the nearest pictures of a picture over the live rows of the image cache.

A picture given as encoded bytes is decoded with the cache's own preprocessing (`cfir_jax.model.preprocess`) and
embedded by the vision tower that built the cache (`cfir_jax.model.image_tower`, at the cache's compute dtype): the
tower of the model that scores the Retriever's queries, whose vision fingerprint the cache's must equal
(`cfir_jax.retrieve.stores`). A picture already indexed may be named by its id instead: its cache row is the query.

The answer is the query's nearest live rows by dot product, searched as the entity index's switch
`index.entity_index.backend` says: 'scann' with the ScaNN searcher the entity index kept over this cache (rows
appended since searched exactly, `cfir_jax.search.knn.search_with_tail`), 'exact' with the SR front end's exact
whole-cache search (on the devices when SR runs there), 'auto' as the entity index was built. Without a stored
searcher (or an entity index: the dense methods open none) the search is exact, and the result's note says which
search answered. Removed rows never answer (`cfir_jax.search.live_rows`). A Retriever class may name another
`picture_search` (a PictureSearch that searches elsewhere): the cluster's front embeds here and searches its shards.

The tower is made once per Retriever, when its first picture arrives; its one program (a batch of one picture, padded
to the local device count) compiles once. The records are the pipeline's `Result` and `Hit`, with no entities.
"""

from __future__ import annotations

import threading
import time
import weakref
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.pipeline import Hit, Result, Retriever
from cfir_jax.retrieve.queries import read_bounded
from cfir_jax.search.knn import ScannSearcher, search_with_tail
from cfir_jax.stores.integrity import check_embeddings, check_scores, row_norm_bound

__all__ = ["PictureSearch", "UnknownPicture", "UnusablePicture", "read_picture", "search_image"]


class UnusablePicture(CfirError):
    """The picture cannot be searched with: empty, undecodable, too large, or this index has no tower to embed it."""


class UnknownPicture(CfirError):
    """No live picture of the index has the id given."""


def read_picture(path: str | Path, limit: int) -> bytes:
    """The bytes of a picture file, refused in one line when missing, not a file, empty or over `limit` bytes."""
    return read_bounded(path, "picture", limit, lambda size: f"{size:,} bytes, over serve.max_image_bytes={limit:,}",
                        UnusablePicture)


class PictureSearch:
    """What one Retriever's picture queries share: its stores, the tower (made on the first picture), the searcher.
    A subclass may search elsewhere: `_searcher` (which search, its note) and `nearest` (query [1, D] -> hits)."""

    def __init__(self, retriever: Retriever):
        # Parts, not the Retriever: the Retriever keys this object weakly, so nothing here may hold it.
        self.stores, self.sr = retriever.stores, retriever.sr
        self.entities = retriever.entities
        self.cache = self.stores.cache
        self.norm = row_norm_bound(self.cache.manifest)  # the largest norm of a stored row
        self._encoder = None
        self.lock = threading.Lock()  # one picture at a time per Retriever (the tower's buffers, lazy loads)
        self.searcher, self.note = self._searcher(str(retriever.config.index.entity_index.backend))

    def exact_note(self) -> str:
        """The result's note when every live row is searched exactly."""
        return f"nearest pictures: exact search over {self.stores.live.num_live:,} live pictures"

    def wants_scann(self, backend: str) -> bool:
        """Whether `backend` (index.entity_index.backend) asks for ScaNN: 'scann', or 'auto' when the entity index
        was built with ScaNN."""
        index = self.stores.entity_index
        return not (backend == "exact" or index is None or
                    (backend == "auto" and index.manifest.get("backend") != "scann"))

    def _searcher(self, backend: str) -> tuple[ScannSearcher | None, str]:
        """The ScaNN searcher the entity index kept over this very cache when `backend` asks for it
        (`wants_scann`); None (exact) otherwise. Also the note that says which search answered."""
        exact, index = self.exact_note(), self.stores.entity_index
        if not self.wants_scann(backend):
            return None, exact
        same_cache = index.manifest.get("cache_fingerprint", self.cache.content_fingerprint) == \
            self.cache.content_fingerprint
        if not index.manifest.get("has_searcher") or not same_cache:
            return None, exact + f" (index.entity_index.backend={backend}, but the entity index kept no ScaNN " \
                "searcher over this cache)"
        loaded = self.entities.searcher if self.entities is not None else None
        return loaded or ScannSearcher.load(index.searcher_dir()), (
            f"nearest pictures: ScaNN over {self.stores.live.num_live:,} live pictures (the entity index's searcher, "
            f"index.entity_index.backend={backend})")

    def encoder(self) -> tuple[object, float]:
        """The vision tower (made and compiled on the first call) and the ms that call spent making it."""
        if self._encoder is not None:
            return self._encoder, 0.0
        manifest = self.cache.manifest
        if manifest.get("source", "model") != "model" or str(self.cache.fingerprint).startswith("precomputed:"):
            raise UnusablePicture(
                f"{self.cache.path}: its embeddings were imported (index.image_cache.precomputed), not made by a "
                "vision tower of this index, so a new picture cannot be embedded like them: query an indexed "
                "picture by its id, or rebuild the cache with --config.index.image_cache.precomputed= --stages "
                "image_cache")
        # why: flax and the vision tower load only when the first picture (not an id) is searched
        from cfir_jax.model.image_tower import ImageEncoder

        t0 = time.perf_counter()
        encoder = ImageEncoder(self.stores.model, str(manifest.get("compute_dtype", "float32")), batch_size=1)
        # The one compile, now: the zero picture's shape is every query's.
        np.asarray(encoder(np.zeros((encoder.batch_size, encoder.image_size, encoder.image_size, 3), np.float32)))
        self._encoder = encoder
        return encoder, 1e3 * (time.perf_counter() - t0)

    def embed(self, image: bytes, times: dict[str, float]) -> np.ndarray:
        """Encoded picture bytes -> its embedding [1, D] float32, the stages' ms into `times`."""
        # why: PIL loads only when a picture is decoded
        from cfir_jax.model.preprocess import ImageDecodeError, decode_image

        encoder, load_ms = self.encoder()
        if load_ms:
            times["tower_load"] = load_ms
        t0 = time.perf_counter()
        try:
            pixels = decode_image(image, encoder.image_size)
        except ImageDecodeError as e:
            raise UnusablePicture(f"the picture ({len(image):,} bytes) cannot be used: {e}") from None
        batch = np.zeros((encoder.batch_size, *pixels.shape), np.float32)
        batch[0] = pixels
        t1 = time.perf_counter()
        query = np.asarray(encoder(batch))[:1]
        times.update(decode=1e3 * (t1 - t0), tower=1e3 * (time.perf_counter() - t1))
        check_embeddings(query, self.stores.model_dir or self.stores.layout.model, "picture")
        return query

    def row_of(self, image_id: str) -> int:
        """The cache row of a live picture, refused (UnknownPicture) when unknown, skipped or removed."""
        try:
            row = self.cache.index_of(image_id)
        except CfirError as e:
            raise UnknownPicture(str(e)) from None
        if self.stores.live.is_removed(np.asarray([row]))[0]:
            raise UnknownPicture(f"{self.cache.path}: image id {image_id!r} was removed (index.py --remove): it "
                                 "answers no query and is none")
        return row

    def nearest(self, query: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """The query's top_k live rows: (scores [k'], rows [k']), best first, padding dropped."""
        if self.searcher is not None:
            scores, rows = search_with_tail(self.searcher, self.cache.embeddings, query, top_k,
                                            self.stores.live.removed)
        else:
            scores, rows = self.sr.exact_search(query, top_k)
        scores, rows = np.asarray(scores[0]), np.asarray(rows[0])
        return scores[rows >= 0], rows[rows >= 0]


_SEARCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Retriever -> PictureSearch
_SEARCHES_LOCK = threading.Lock()


def _search_of(retriever: Retriever) -> PictureSearch:
    """The retriever's picture search, made on its first picture: its class's `picture_search` (the cluster's front
    searches on the shards, `cfir_jax.serve.merge.ShardedPictureSearch`), or PictureSearch."""
    with _SEARCHES_LOCK:
        if retriever not in _SEARCHES:
            _SEARCHES[retriever] = getattr(type(retriever), "picture_search", PictureSearch)(retriever)
        return _SEARCHES[retriever]


def search_image(retriever: Retriever, *, image: bytes | None = None, image_id: str | None = None,
                 top_k: int) -> Result:
    """The top_k nearest live pictures of a picture: given as encoded bytes (`image`: JPEG, PNG, WebP, ...; embedded
    by the index's vision tower) or as the id of an indexed picture (`image_id`: its cached row). Raises
    UnusablePicture (bad bytes, no tower), UnknownPicture (no live picture of that id) or CfirError (arguments).

    times_ms: decode, tower (and tower_load on the query that made it) or lookup; search; hits."""
    if (image is None) == (image_id is None):
        raise CfirError("give a picture's bytes (image) or an indexed picture's id (image_id), not both or neither")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise CfirError(f"top_k must be a positive integer, got {top_k!r}")
    engine = _search_of(retriever)
    times: dict[str, float] = {}
    with engine.lock:
        if image is not None:
            if not isinstance(image, (bytes, bytearray, memoryview)) or not len(image):
                raise UnusablePicture("the picture is empty" if isinstance(image, (bytes, bytearray, memoryview))
                                      else f"image must be the picture's bytes, got {type(image).__name__}")
            query, query_norm = engine.embed(bytes(image), times), 1.0
        else:
            t0 = time.perf_counter()
            query = engine.cache.gather([engine.row_of(image_id)])
            times["lookup"], query_norm = 1e3 * (time.perf_counter() - t0), engine.norm
        t1 = time.perf_counter()
        scores, rows = engine.nearest(query, top_k)
        t2 = time.perf_counter()
    check_scores(scores, query_norm * engine.norm, str(engine.cache.path))  # a damaged row: one line, never a hit
    ids = engine.cache.ids
    hits = [Hit(n + 1, ids[int(r)], float(s), int(r)) for n, (s, r) in enumerate(zip(scores, rows))]
    times.update(search=1e3 * (t2 - t1), hits=1e3 * (time.perf_counter() - t2))
    return Result(hits, [], [], "", engine.note, engine.stores.live.num_live, times)
